//! The per-key hold queues of one partition, the due times of their keys' backoffs and the
//! quarantine of suspects of repeated crashes (SUB-1, SUB-2, DLQ-1, DLQ-3), as
//! `ordering_layer/subscriber/key_queue.py`.
//!
//! Queues live in the partition's slab and are named by slot; the ready list and the quarantine's
//! waiting list are queues of (slot, stamp) pairs where a pair whose stamp is no longer its queue's
//! is stale and skipped, which gives a Python dict's insertion order with O(1) removal.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::collections::VecDeque;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::ops::Deref;

/// Suspects charged this many attempts or more are quarantined (`key_queue.QUARANTINE_FROM`): one
/// crash charges what was out one attempt, and those suspects go out together; from a second crash
/// on each goes out alone, so an innocent is charged for two crashes at most.
pub const QUARANTINE_FROM: u32 = 2;

/// Keys up to this many bytes are kept inline (`KeyBytes`).
const INLINE: usize = 30;

/// An ordering key's bytes: inline when short, as most keys are, so that making, cloning and
/// dropping a key's queue allocates nothing for it; boxed otherwise. Hashes and compares as the
/// bytes (`Borrow<[u8]>`: a map keyed by it is looked up by a byte slice).
#[derive(Clone)]
pub enum KeyBytes {
    Inline(u8, [u8; INLINE]),
    Boxed(Box<[u8]>),
}

impl KeyBytes {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            KeyBytes::Inline(len, bytes) => &bytes[..usize::from(*len)],
            KeyBytes::Boxed(bytes) => bytes,
        }
    }
}

impl From<&[u8]> for KeyBytes {
    fn from(bytes: &[u8]) -> Self {
        if bytes.len() <= INLINE {
            let mut inline = [0u8; INLINE];
            inline[..bytes.len()].copy_from_slice(bytes);
            KeyBytes::Inline(bytes.len() as u8, inline)
        } else {
            KeyBytes::Boxed(bytes.into())
        }
    }
}

impl Deref for KeyBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Borrow<[u8]> for KeyBytes {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

impl PartialEq for KeyBytes {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for KeyBytes {}

impl Hash for KeyBytes {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl fmt::Debug for KeyBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.as_slice().fmt(f)
    }
}

/// What a record queues under.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum QueueKey {
    Key(KeyBytes),
    Offset(i64),
}

/// One fetched record of a key's queue; `item` is the caller's (the Python record object).
/// `suspect`: an earlier owner handed it out and never settled it (ACK-6), so each start of it is
/// to be written before user code runs; `quarantined`: a suspect charged `QUARANTINE_FROM`
/// attempts or more, which goes out alone (`Quarantine`). `released`: an attempt of it was queued
/// for Redis already, so the next one is not its first (`runs.rs`: first attempts are written as
/// runs of offsets); `in_hash`: the attempts hash may hold a field of it, to be deleted when it is
/// settled.
pub struct Entry<T> {
    pub offset: i64,
    pub size: i64,
    pub attempts: u32,
    pub suspect: bool,
    pub quarantined: bool,
    pub released: bool,
    pub in_hash: bool,
    pub token: u64, // 0: not outstanding
    pub acked: bool,
    pub item: T,
}

/// Fetched records of one ordering key (or one unordered record) in offset order; the first
/// `cursor` have been delivered since the key's last reset.
pub struct KeyQueue<T> {
    pub qkey: QueueKey,
    pub records: VecDeque<Entry<T>>,
    pub cursor: usize,
    pub outstanding: usize,
    pub failures: u32,
    pub not_before: f64,
    pub ready_stamp: u64,   // 0: not in the ready list
    pub waiting_stamp: u64, // 0: not in the quarantine's waiting list
    pub backing_off: bool,
    pub moved: bool, // held until its key's records in its old partitions are settled (`moves`)
    pub moved_from: i64, // while `moved`: the offset of its first record that waits (those before go out)
}

impl<T> KeyQueue<T> {
    /// A key's queue, its records kept in `records` (empty; a spare one keeps its capacity).
    pub fn new(qkey: QueueKey, records: VecDeque<Entry<T>>) -> Self {
        KeyQueue {
            qkey,
            records,
            cursor: 0,
            outstanding: 0,
            failures: 0,
            not_before: 0.0,
            ready_stamp: 0,
            waiting_stamp: 0,
            backing_off: false,
            moved: false,
            moved_from: 0,
        }
    }

    /// Whether a move holds the queue now: its next record is one that waits for the key's old
    /// partitions (records of the key before that one go out as usual).
    pub fn held(&self) -> bool {
        self.moved && self.records.get(self.cursor).is_none_or(|entry| entry.offset >= self.moved_from)
    }

    pub fn index_of(&self, offset: i64) -> Option<usize> {
        self.records.binary_search_by_key(&offset, |entry| entry.offset).ok()
    }
}

/// The end of a key's backoff, in a min-heap by (due, seq).
pub struct Wake {
    pub due: f64,
    pub seq: u64,
    pub qkey: QueueKey,
}

impl PartialEq for Wake {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Wake {}

impl PartialOrd for Wake {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Wake {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap.
        other.due.total_cmp(&self.due).then(other.seq.cmp(&self.seq))
    }
}

/// At most one quarantined record of a partition outstanding at a time (ACK-6, DLQ-3).
///
/// A suspect may be what crashed the partition's earlier owners; run alone, its crashes charge only
/// itself. A queue whose next record is quarantined waits (oldest first) while another quarantined
/// record is outstanding (`offset`); once that one is settled in any way (ack, nack, lapse, dead
/// letter, given back), the oldest waiting queue is ready again. A queue keeps its place in the
/// waiting list when it is looked at again while it waits.
#[derive(Default)]
pub struct Quarantine {
    pub offset: Option<i64>,
    waiting: VecDeque<(u32, u64)>,
    stamps: u64,
}

impl Quarantine {
    /// Whether the quarantined record `offset`, next of `queue` (in `slot`), may go out now; if
    /// not, the queue waits.
    pub fn admit<T>(&mut self, slot: u32, queue: &mut KeyQueue<T>, offset: i64) -> bool {
        if self.offset.is_some() {
            if queue.waiting_stamp == 0 {
                self.stamps += 1;
                queue.waiting_stamp = self.stamps;
                self.waiting.push_back((slot, self.stamps));
            }
            return false;
        }
        self.offset = Some(offset);
        queue.waiting_stamp = 0;
        true
    }

    /// The outstanding quarantined record is settled or given back: the slot of the oldest waiting queue, no
    /// longer waiting, for the caller to make ready.
    pub fn settled<T>(&mut self, slots: &mut [Option<KeyQueue<T>>]) -> Option<u32> {
        self.offset = None;
        while let Some((slot, stamp)) = self.waiting.pop_front() {
            if let Some(Some(queue)) = slots.get_mut(slot as usize) {
                if queue.waiting_stamp == stamp {
                    queue.waiting_stamp = 0;
                    return Some(slot);
                }
            }
        }
        None
    }

    /// The slots of the waiting queues, oldest first.
    pub fn waiting<'a, T>(&'a self, slots: &'a [Option<KeyQueue<T>>]) -> impl Iterator<Item = u32> + 'a {
        self.waiting
            .iter()
            .filter(|&&(slot, stamp)| matches!(slots.get(slot as usize), Some(Some(q)) if q.waiting_stamp == stamp))
            .map(|&(slot, _)| slot)
    }
}

#[cfg(test)]
mod tests {
    use super::KeyBytes;
    use foldhash::{HashMap, HashMapExt};

    #[test]
    fn key_bytes_look_up_as_byte_slices_short_or_long() {
        let long = [7u8; 100];
        let mut map: HashMap<KeyBytes, u32> = HashMap::new();
        map.insert(KeyBytes::from(&b"key-1"[..]), 1);
        map.insert(KeyBytes::from(&long[..]), 2);
        map.insert(KeyBytes::from(&b""[..]), 3);
        assert!(matches!(KeyBytes::from(&b"key-1"[..]), KeyBytes::Inline(5, _)));
        assert!(matches!(KeyBytes::from(&long[..]), KeyBytes::Boxed(_)));
        assert_eq!((map.get(&b"key-1"[..]), map.get(&long[..]), map.get(&b""[..])), (Some(&1), Some(&2), Some(&3)));
        assert_eq!(map.get(&b"key-2"[..]), None);
        assert_eq!(&*KeyBytes::from(&long[..]), &long[..]);
    }
}
