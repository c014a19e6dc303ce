//! State ops of one partition, packed `"<letter>,<offset>,<value>;"` each; the state store sends
//! them to `apply.lua` as the Redis command runs they make (`runs.rs`).
//!
//! The letters are defined here; `OpKind` (`ordering_layer/state/store.py`) reads them (`LETTERS`). Every op of a partition goes through
//! one buffer, in the order decided, because their writes are applied in sequence (a lease extension
//! queued after a settle would bring the lease back).

/// Appends `value` in decimal, as `write!` would (without its formatting machinery: two ops are
/// packed per message).
fn push_decimal(packed: &mut Vec<u8>, value: i64) {
    let mut digits = [0u8; 20];
    let mut rest = value.unsigned_abs();
    let mut start = digits.len();
    loop {
        start -= 1;
        digits[start] = b'0' + (rest % 10) as u8;
        rest /= 10;
        if rest == 0 {
            break;
        }
    }
    if value < 0 {
        packed.push(b'-');
    }
    packed.extend_from_slice(&digits[start..]);
}

pub const DELIVERED: char = 'd';
pub const LEASE: char = 'l';
pub const BATCH_LEASE: char = 'b';
pub const BATCH_DELIVERED: char = 'e';
pub const RELEASED: char = 'r';
pub const BATCH_RELEASED: char = 'q';
pub const FIRST_DELIVERED: char = 'D';
pub const FIRST_RELEASED: char = 'R';
pub const BATCH_FIRST_DELIVERED: char = 'E';
pub const BATCH_FIRST_RELEASED: char = 'Q';
pub const STARTED: char = 's';
pub const SETTLED: char = 'a';
/// Bits of a `SETTLED` op's value: no lease of the delivery was written; no attempts-hash field
/// holds its attempt (its only attempt was written as part of a first-attempt run).
pub const SETTLED_NO_LEASE: i64 = 1;
pub const SETTLED_NO_ATTEMPT_FIELD: i64 = 2;
pub const NACKED: char = 'n';
pub const UNSETTLED: char = 'u';
pub const CASCADE_FROM: char = 'c';
pub const CASCADE_DONE: char = 'x';
pub const FLOOR: char = 'f';

/// Every op, by its `OpKind` name (exported to Python as `OP_LETTERS`, which `OpKind` reads).
pub const LETTERS: [(&str, char); 17] = [
    ("DELIVERED", DELIVERED), ("LEASE", LEASE), ("BATCH_LEASE", BATCH_LEASE), ("BATCH_DELIVERED", BATCH_DELIVERED),
    ("RELEASED", RELEASED), ("BATCH_RELEASED", BATCH_RELEASED), ("FIRST_DELIVERED", FIRST_DELIVERED),
    ("FIRST_RELEASED", FIRST_RELEASED), ("BATCH_FIRST_DELIVERED", BATCH_FIRST_DELIVERED),
    ("BATCH_FIRST_RELEASED", BATCH_FIRST_RELEASED), ("STARTED", STARTED), ("SETTLED", SETTLED), ("NACKED", NACKED),
    ("UNSETTLED", UNSETTLED), ("CASCADE_FROM", CASCADE_FROM), ("CASCADE_DONE", CASCADE_DONE), ("FLOOR", FLOOR),
];

/// Ops queued since the last `take`.
#[derive(Default)]
pub struct OpBuffer {
    packed: Vec<u8>, // UTF-8: the letters as chars, the rest ASCII
    pub count: usize,
}

impl OpBuffer {
    pub fn push(&mut self, kind: char, offset: i64, value: i64) {
        let packed = &mut self.packed;
        if kind.is_ascii() {
            packed.push(kind as u8);
        } else {
            packed.extend_from_slice(kind.encode_utf8(&mut [0; 4]).as_bytes());
        }
        packed.push(b',');
        push_decimal(packed, offset);
        packed.push(b',');
        push_decimal(packed, value);
        packed.push(b';');
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
        String::from_utf8(std::mem::take(&mut self.packed)).expect("chars and ASCII are UTF-8")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_are_packed_as_write_packs_them() {
        let mut buffer = OpBuffer::default();
        let values = [0, 7, -7, 10, 1_700_000_000_000, i64::MAX, i64::MIN];
        for &value in &values {
            buffer.push(SETTLED, value, value.saturating_neg());
        }
        let expected: String = values.iter().map(|value| format!("a,{value},{};", value.saturating_neg())).collect();
        assert_eq!((buffer.take(), buffer.count), (expected, 0));
        buffer.push('é', 1, 2); // a letter decided in Python is any char (`push_op`)
        assert_eq!(buffer.take(), "é,1,2;");
    }
}
