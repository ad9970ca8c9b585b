//! jetrl rollout worker service
