//! State ops of one partition, packed `"<letter>,<offset>,<value>;"` each; the state store sends
//! them to `apply.lua` as the Redis command runs they make (`runs.rs`).
//!
//! The letters are `OpKind`'s (`ordering_layer/state/store.py`). Every op of a partition goes through
//! one buffer, in the order decided, because their writes are applied in sequence (a lease extension
//! queued after a settle would bring the lease back).

use std::fmt::Write;

pub const DELIVERED: char = 'd';
pub const LEASE: char = 'l';
pub const BATCH_LEASE: char = 'b';
pub const BATCH_DELIVERED: char = 'e';
pub const RELEASED: char = 'r';
pub const BATCH_RELEASED: char = 'q';
pub const SETTLED: char = 'a';
pub const NACKED: char = 'n';
pub const UNSETTLED: char = 'u';
pub const CASCADE_FROM: char = 'c';
pub const CASCADE_DONE: char = 'x';
pub const FLOOR: char = 'f';

/// Ops queued since the last `take`.
#[derive(Default)]
pub struct OpBuffer {
    packed: String,
    pub count: usize,
}

impl OpBuffer {
    pub fn push(&mut self, kind: char, offset: i64, value: i64) {
        // Writing into a String cannot fail.
        let _ = write!(self.packed, "{kind},{offset},{value};");
        self.count += 1;
    }

    /// Where the buffer ends now, to drop what was pushed after it (`truncate`).
    pub fn mark(&self) -> (usize, usize) {
        (self.packed.len(), self.count)
    }

    pub fn truncate(&mut self, mark: (usize, usize)) {
        self.packed.truncate(mark.0);
        self.count = mark.1;
    }

    /// The packed ops, and the buffer emptied.
    pub fn take(&mut self) -> String {
        self.count = 0;
        std::mem::take(&mut self.packed)
    }
}
