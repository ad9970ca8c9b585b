//! RL math: advantage estimators, policy losses, aggregation, KL
