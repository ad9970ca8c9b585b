//! the jetrl command line
