//! jetrl checkpoint-sync service
