//! jetrl trainer service
