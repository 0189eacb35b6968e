//! Prefix reuse, the part both sides agree on.
//!
//! A worker's KV cache keys each *full* block of a prompt by a chained hash:
//! the parent block's hash and this block's token ids, starting from a seed
//! that names everything else the KV depends on (the model, its config, the
//! block size). Equal hashes mean equal prefixes, up to collisions, so:
//!
//! - the worker ([`hash`]) looks blocks up by hash and then checks the
//!   stored token ids, so a collision can never hand out the wrong KV;
//! - the router computes the same hashes of a request's tokens and counts
//!   how many leading blocks each worker holds ([`log::Mirror`]), learning
//!   what each holds from the worker's own cache events ([`log::CacheLog`]),
//!   never from what it sent itself. A collision there only costs a
//!   routing choice.

pub mod hash;
pub mod log;

pub use hash::{chain, seed, BlockHash};
pub use log::{fresh_epoch, CacheLog, Delta, Event, Mirror};
