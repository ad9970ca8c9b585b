//! cross-service end-to-end and fault-injection tests
