//! datasets, built-in tasks, chat templates
