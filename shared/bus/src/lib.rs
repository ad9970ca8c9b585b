//! NATS JetStream plumbing: connect, declare, publish with de-duplication, consume, test harness
