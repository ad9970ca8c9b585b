//! jetrl replay buffer service
