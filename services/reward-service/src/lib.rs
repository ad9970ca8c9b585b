//! jetrl reward service
