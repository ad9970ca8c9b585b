//! The tokenizer side of an HF checkpoint, without libtorch: `tokenizer.json` (HF `tokenizers`), the special
//! tokens around it, and chat templates rendered the way transformers' `apply_chat_template` renders them.
//!
//! It is its own crate so that services that only read text — the reward service rendering a reward model's
//! prompt, a dataset tool — do not link libtorch. `jetrl-model` re-exports everything here unchanged.
//!
//! - [`tokenizer`]: [`Tokenizer::from_dir`], `encode`/`decode`, EOS/pad/BOS, [`Tokenizer::render_chat`] and
//!   [`Tokenizer::apply_chat_template`].
//! - [`chat_template`]: [`ChatTemplate`], a compiled template in a transformers-compatible jinja environment.

pub mod chat_template;
mod error;
pub mod tokenizer;

pub use chat_template::ChatTemplate;
pub use error::{Result, TokenizerError};
pub use tokenizer::Tokenizer;
