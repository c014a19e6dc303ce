//! Dispatch state of one owned partition: per-key hold queues, release, settlement, cascade, recovery.
//!
//! The same semantics as `ordering_layer/subscriber/partition.py` (`PartitionState`), kept
//! operation for operation (tests/unit/test_core.py drives both with the same random sequences):
//!
//! * a queue key is the record's ordering key when ordering is on and the key is not empty, else
//!   the record's offset (an unordered record queues alone);
//! * a key's queue holds its fetched records from its first unsettled one; the first `cursor`
//!   have been delivered since the key's last reset; a nack or lapse of one of them rewinds the
//!   cursor to it, so it and every later delivered record go out again in order (SUB-4);
//! * the ready keys are released oldest first (insertion order, as a Python dict keeps it): a key
//!   leaves the ready set when looked at and comes back on an ack, a nack or the end of a backoff;
//! * records settled before a crash are skipped at intake unless their key cascades (SUB-3).
//!
//! Queues live in a slab (`slots`) so that the ready list and outstanding offsets refer to them by
//! index; the ready list is a queue of (slot, stamp) pairs where a pair whose stamp is no longer
//! its queue's is stale and skipped, which gives a dict's order with O(1) removal.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};

use crate::ops::{self, OpBuffer};
use crate::tracker::OffsetTracker;

/// Delivery tokens, unique in the process: a stale token (a delivery of an earlier ownership or
/// before a redelivery) never matches a new one.
static TOKENS: AtomicU64 = AtomicU64::new(1);

/// What a record queues under.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub enum QueueKey {
    Key(Box<[u8]>),
    Offset(i64),
}

/// One fetched record of a key's queue; `item` is the caller's (the Python record object).
pub struct Entry<T> {
    pub offset: i64,
    pub size: i64,
    pub attempts: u32,
    token: u64, // 0: not outstanding
    acked: bool,
    pub item: T,
}

struct KeyQueue<T> {
    qkey: QueueKey,
    records: VecDeque<Entry<T>>,
    cursor: usize,
    outstanding: usize,
    failures: u32,
    not_before: f64,
    ready_stamp: u64, // 0: not in the ready set
    backing_off: bool,
}

impl<T> KeyQueue<T> {
    fn new(qkey: QueueKey) -> Self {
        KeyQueue {
            qkey,
            records: VecDeque::new(),
            cursor: 0,
            outstanding: 0,
            failures: 0,
            not_before: 0.0,
            ready_stamp: 0,
            backing_off: false,
        }
    }

    fn index_of(&self, offset: i64) -> Option<usize> {
        self.records.binary_search_by_key(&offset, |entry| entry.offset).ok()
    }
}

/// The end of a key's backoff, in a min-heap by (due, seq).
struct Wake {
    due: f64,
    seq: u64,
    qkey: QueueKey,
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

/// What `release_ready` handed out: count and payload bytes.
pub struct ReleaseTotals {
    pub count: usize,
    pub bytes: i64,
}

/// Dispatch state of one partition; `T` is the caller's record object.
pub struct PartitionCore<T> {
    ordered: bool,
    tracker: OffsetTracker,
    slots: Vec<Option<KeyQueue<T>>>,
    free: Vec<u32>,
    by_key: HashMap<Box<[u8]>, u32>,
    by_offset: HashMap<i64, u32>,
    delivered: HashMap<i64, u32>, // outstanding offset -> slot of its queue
    ready: VecDeque<(u32, u64)>,
    stamps: u64,
    wakes: BinaryHeap<Wake>,
    wake_seq: u64,
    pub buffered: i64,
    settled_before: HashSet<i64>,
    horizon: i64,
    cascading: HashSet<QueueKey>,
    attempts_before: HashMap<i64, u32>,
    pub ops: OpBuffer,
}

impl<T> PartitionCore<T> {
    /// `settled_before` and `attempts_before` come from the claim (the recovery walk, ACK-6).
    pub fn new(ordered: bool, settled_before: HashSet<i64>, attempts_before: HashMap<i64, u32>) -> Self {
        let horizon = settled_before.iter().copied().max().unwrap_or(-1);
        PartitionCore {
            ordered,
            tracker: OffsetTracker::default(),
            slots: Vec::new(),
            free: Vec::new(),
            by_key: HashMap::new(),
            by_offset: HashMap::new(),
            delivered: HashMap::new(),
            ready: VecDeque::new(),
            stamps: 0,
            wakes: BinaryHeap::new(),
            wake_seq: 0,
            buffered: 0,
            settled_before,
            horizon,
            cascading: HashSet::new(),
            attempts_before,
            ops: OpBuffer::default(),
        }
    }

    pub fn watermark(&self) -> Option<i64> {
        self.tracker.watermark()
    }

    pub fn next_offset(&self) -> Option<i64> {
        self.tracker.next_offset
    }

    fn queue_key(&self, offset: i64, key: Option<&[u8]>) -> QueueKey {
        match key {
            Some(key) if self.ordered && !key.is_empty() => QueueKey::Key(key.into()),
            _ => QueueKey::Offset(offset),
        }
    }

    fn slot_of(&self, qkey: &QueueKey) -> Option<u32> {
        match qkey {
            QueueKey::Key(key) => self.by_key.get(key.as_ref()).copied(),
            QueueKey::Offset(offset) => self.by_offset.get(offset).copied(),
        }
    }

    fn queue(&mut self, slot: u32) -> &mut KeyQueue<T> {
        self.slots[slot as usize].as_mut().expect("a live slot")
    }

    /// The slot of the key's queue, made when the key has none (no key bytes copied when it has).
    fn slot_for(&mut self, offset: i64, key: Option<&[u8]>) -> u32 {
        let keyed = match key {
            Some(key) if self.ordered && !key.is_empty() => Some(key),
            _ => None,
        };
        let found = match keyed {
            Some(key) => self.by_key.get(key).copied(),
            None => self.by_offset.get(&offset).copied(),
        };
        if let Some(slot) = found {
            return slot;
        }
        let qkey = match keyed {
            Some(key) => QueueKey::Key(key.into()),
            None => QueueKey::Offset(offset),
        };
        let queue = KeyQueue::new(qkey.clone());
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(queue);
                slot
            }
            None => {
                self.slots.push(Some(queue));
                (self.slots.len() - 1) as u32
            }
        };
        match qkey {
            QueueKey::Key(key) => self.by_key.insert(key, slot),
            QueueKey::Offset(offset) => self.by_offset.insert(offset, slot),
        };
        slot
    }

    fn mark_ready(&mut self, slot: u32) {
        if self.slots[slot as usize].as_ref().is_some_and(|q| q.ready_stamp == 0) {
            self.stamps += 1;
            let stamp = self.stamps;
            self.queue(slot).ready_stamp = stamp;
            self.ready.push_back((slot, stamp));
        }
    }

    fn is_ready(&self, slot: u32, stamp: u64) -> bool {
        matches!(self.slots.get(slot as usize), Some(Some(queue)) if queue.ready_stamp == stamp)
    }

    // -- intake ------------------------------------------------------------------------------------

    /// Take a fetched record; false when it is skipped (a duplicate, or settled before a crash).
    pub fn add(&mut self, offset: i64, key: Option<&[u8]>, size: i64, item: T) -> bool {
        if self.tracker.next_offset.is_some_and(|next| offset < next) {
            return false;
        }
        self.tracker.add(offset);
        if offset <= self.horizon {
            let qkey = self.queue_key(offset, key);
            if self.settled_before.contains(&offset) && !self.cascading.contains(&qkey) {
                self.tracker.settle(offset);
                return false;
            }
            self.cascading.insert(qkey);
        } else if self.horizon >= 0 {
            self.horizon = -1;
            self.settled_before.clear();
            self.cascading.clear();
        }
        let attempts = self.attempts_before.remove(&offset).unwrap_or(0);
        let slot = self.slot_for(offset, key);
        let queue = self.queue(slot);
        queue.records.push_back(Entry { offset, size, attempts, token: 0, acked: false, item });
        let idle = queue.outstanding == 0 && !queue.backing_off;
        self.buffered += 1;
        if idle {
            self.mark_ready(slot);
        }
        true
    }

    // -- release -----------------------------------------------------------------------------------

    /// Release from the ready keys, oldest first: up to `per_key` records of each, `budget` records
    /// in all, and no further key once `byte_budget` payload bytes are used up. The keys looked at
    /// leave the ready set. `emit` sees each released record with its token; with `lease_ms` the
    /// attempts go out as one batch lease plus `BATCH_DELIVERED` ops, else as `DELIVERED` ops.
    pub fn release_ready(
        &mut self,
        now: f64,
        mut budget: i64,
        per_key: i64,
        mut byte_budget: i64,
        lease_ms: Option<i64>,
        mut emit: impl FnMut(&Entry<T>, u64),
    ) -> ReleaseTotals {
        let mut looked = 0;
        let mut totals = ReleaseTotals { count: 0, bytes: 0 };
        let mark = self.ops.mark();
        let delivered_kind = match lease_ms {
            Some(lease) => {
                self.ops.push(ops::BATCH_LEASE, 0, lease);
                ops::BATCH_DELIVERED
            }
            None => ops::DELIVERED,
        };
        // The keys looked at are the first `budget` ready ones when the call starts (Python's
        // `islice(ready, budget)`); releasing adds no key, so walking the live front is the same.
        let snapshot = budget.max(0);
        while looked < snapshot {
            let Some(&(slot, stamp)) = self.ready.front() else { break };
            if !self.is_ready(slot, stamp) {
                self.ready.pop_front();
                continue;
            }
            if budget <= 0 || byte_budget <= 0 {
                break;
            }
            self.ready.pop_front();
            looked += 1;
            let limit = per_key.min(budget).max(0) as usize;
            let queue = self.slots[slot as usize].as_mut().expect("a ready slot");
            queue.ready_stamp = 0;
            if queue.outstanding > 0 || now < queue.not_before || queue.cursor >= queue.records.len() {
                continue;
            }
            let start = queue.cursor;
            let end = (start + limit).min(queue.records.len());
            for entry in queue.records.range_mut(start..end) {
                let token = TOKENS.fetch_add(1, AtomicOrdering::Relaxed);
                entry.token = token;
                entry.attempts += 1;
                self.delivered.insert(entry.offset, slot);
                self.ops.push(delivered_kind, entry.offset, i64::from(entry.attempts));
                byte_budget -= entry.size;
                totals.bytes += entry.size;
                emit(entry, token);
            }
            let released = end - start;
            queue.outstanding += released;
            queue.cursor = end;
            self.buffered -= released as i64;
            budget -= released as i64;
            totals.count += released;
        }
        if totals.count == 0 {
            self.ops.truncate(mark);
        }
        totals
    }

    // -- settlement --------------------------------------------------------------------------------

    /// The outstanding entry of `offset` if `token` is its current one: (slot, index in its queue).
    fn outstanding(&self, offset: i64, token: u64) -> Option<(u32, usize)> {
        let slot = *self.delivered.get(&offset)?;
        let queue = self.slots[slot as usize].as_ref()?;
        let index = queue.index_of(offset)?;
        (queue.records[index].token == token).then_some((slot, index))
    }

    /// Settle a delivery; false when the token is stale (redelivered since, or never issued).
    pub fn ack(&mut self, offset: i64, token: u64) -> bool {
        let Some((slot, index)) = self.outstanding(offset, token) else { return false };
        self.delivered.remove(&offset);
        let queue = self.queue(slot);
        let entry = &mut queue.records[index];
        entry.token = 0;
        entry.acked = true;
        queue.outstanding -= 1;
        queue.failures = 0;
        self.tracker.settle(offset);
        self.ops.push(ops::SETTLED, offset, 0);
        self.pop_settled(slot);
        true
    }

    /// Settle a delivered record without an ack (dead-lettered: DLQ-2). Its settle op is queued
    /// even when the key's queue is gone.
    pub fn settle_dead_lettered(&mut self, offset: i64, key: Option<&[u8]>) {
        self.ops.push(ops::SETTLED, offset, 0);
        let Some(slot) = self.slot_of(&self.queue_key(offset, key)) else { return };
        let queue = self.queue(slot);
        let mut was_outstanding = false;
        if let Some(index) = queue.index_of(offset) {
            let entry = &mut queue.records[index];
            was_outstanding = entry.token != 0;
            entry.token = 0;
            entry.acked = true;
            if was_outstanding {
                queue.outstanding -= 1;
            }
        }
        if was_outstanding {
            self.delivered.remove(&offset);
        }
        self.tracker.settle(offset);
        self.pop_settled(slot);
    }

    fn pop_settled(&mut self, slot: u32) {
        let queue = self.queue(slot);
        while queue.cursor > 0 && queue.records.front().is_some_and(|entry| entry.acked && entry.token == 0) {
            queue.records.pop_front();
            queue.cursor -= 1;
        }
        if queue.records.is_empty() {
            let qkey = queue.qkey.clone();
            match qkey {
                QueueKey::Key(key) => self.by_key.remove(&key),
                QueueKey::Offset(offset) => self.by_offset.remove(&offset),
            };
            self.slots[slot as usize] = None;
            self.free.push(slot);
        } else if queue.outstanding == 0 && !queue.backing_off {
            self.mark_ready(slot);
        }
    }

    /// Give a delivery back (nack or lapsed lease): rewind its key to it (SUB-4) and back off the
    /// key (DLQ-1) by `backoff(failures in a row)`. False when the token is stale.
    pub fn nack<E>(&mut self, offset: i64, token: u64, now: f64,
                   backoff: impl FnOnce(u32) -> Result<f64, E>) -> Result<bool, E> {
        let Some(slot) = self.rewind(offset, token) else { return Ok(false) };
        self.ops.push(ops::NACKED, offset, 0);
        let queue = self.queue(slot);
        queue.failures += 1;
        let delay = backoff(queue.failures)?;
        self.hold(slot, now, delay);
        Ok(true)
    }

    /// Give a delivery back because the layer failed, not the message: rewind as `nack` does and
    /// hold the key `delay` seconds without counting a failure. With `uncount` the attempt is taken
    /// back too (the attempt count never reached Redis). False when the token is stale.
    pub fn requeue(&mut self, offset: i64, token: u64, now: f64, delay: f64, uncount: bool) -> bool {
        if uncount {
            if let Some((slot, index)) = self.outstanding(offset, token) {
                let entry = &mut self.queue(slot).records[index];
                entry.attempts = entry.attempts.saturating_sub(1);
            }
        }
        let Some(slot) = self.rewind(offset, token) else { return false };
        self.hold(slot, now, delay);
        true
    }

    fn rewind(&mut self, offset: i64, token: u64) -> Option<u32> {
        let (slot, index) = self.outstanding(offset, token)?;
        let queue = self.slots[slot as usize].as_mut().expect("a live slot");
        for entry in queue.records.range_mut(index..queue.cursor) {
            if entry.token != 0 {
                entry.token = 0;
                queue.outstanding -= 1;
                self.delivered.remove(&entry.offset);
            }
            entry.acked = false;
        }
        self.buffered += (queue.cursor - index) as i64;
        queue.cursor = index;
        Some(slot)
    }

    fn hold(&mut self, slot: u32, now: f64, delay: f64) {
        let queue = self.slots[slot as usize].as_mut().expect("a live slot");
        queue.not_before = now + delay;
        if delay > 0.0 {
            queue.backing_off = true;
            queue.ready_stamp = 0;
            let wake = Wake { due: queue.not_before, seq: self.wake_seq, qkey: queue.qkey.clone() };
            self.wake_seq += 1;
            self.wakes.push(wake);
            return;
        }
        queue.backing_off = false;
        if queue.outstanding == 0 {
            self.mark_ready(slot);
        }
    }

    /// Move keys whose backoff has ended back to the ready set (due-time order, no scan).
    pub fn wake(&mut self, now: f64) {
        while self.wakes.peek().is_some_and(|wake| wake.due <= now) {
            let wake = self.wakes.pop().expect("peeked");
            let Some(slot) = self.slot_of(&wake.qkey) else { continue };
            let queue = self.queue(slot);
            // Else held again since: a later entry wakes it.
            if queue.backing_off && queue.not_before == wake.due {
                queue.backing_off = false;
                if queue.outstanding == 0 {
                    self.mark_ready(slot);
                }
            }
        }
    }

    /// The earliest end of a backoff, if any key is backing off.
    pub fn next_wake(&self) -> Option<f64> {
        self.wakes.peek().map(|wake| wake.due)
    }

    /// Keys with something outstanding or backing off (a scan: for metrics, not the hot path).
    pub fn held_keys(&self) -> usize {
        self.slots.iter().flatten().filter(|queue| queue.outstanding > 0 || queue.backing_off).count()
    }

    /// The ready keys, oldest first (a scan: for tests and metrics).
    pub fn ready_keys(&self) -> Vec<&QueueKey> {
        self.ready
            .iter()
            .filter(|&&(slot, stamp)| self.is_ready(slot, stamp))
            .map(|&(slot, _)| &self.slots[slot as usize].as_ref().expect("a ready slot").qkey)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{PartitionCore, QueueKey};
    use foldhash::{HashMap, HashMapExt, HashSet, HashSetExt};

    fn state(ordered: bool, keys: &[&[u8]]) -> PartitionCore<()> {
        let mut core = PartitionCore::new(ordered, HashSet::new(), HashMap::new());
        for (offset, key) in keys.iter().enumerate() {
            assert!(core.add(offset as i64, Some(key), 1, ()));
        }
        core
    }

    fn release(core: &mut PartitionCore<()>, per_key: i64) -> Vec<(i64, u64)> {
        let mut out = Vec::new();
        core.release_ready(0.0, 1_000, per_key, 1_000, None, |entry, token| out.push((entry.offset, token)));
        out
    }

    #[test]
    fn one_outstanding_per_key_and_keys_independent() {
        let mut core = state(true, &[b"a", b"b", b"a", b"b", b"a"]);
        let first = release(&mut core, 1);
        assert_eq!(first.iter().map(|d| d.0).collect::<Vec<_>>(), vec![0, 1]);
        assert!(release(&mut core, 1).is_empty());
        assert!(core.ack(1, first[1].1));
        assert_eq!(release(&mut core, 1).iter().map(|d| d.0).collect::<Vec<_>>(), vec![3]);
        assert!(core.ack(0, first[0].1));
        assert_eq!(release(&mut core, 1).iter().map(|d| d.0).collect::<Vec<_>>(), vec![2]);
        assert_eq!(core.watermark(), Some(2));
        assert_eq!(core.ops.take(), "d,0,1;d,1,1;a,1,0;d,3,1;a,0,0;d,2,1;");
    }

    #[test]
    fn nack_rewinds_and_cascades() {
        let mut core = state(true, &[b"k", b"k", b"k"]);
        let batch = release(&mut core, 10);
        assert!(core.ack(2, batch[2].1));
        assert!(core.nack(1, batch[1].1, 0.0, |_| Ok::<f64, ()>(0.0)).unwrap());
        assert!(!core.ack(2, batch[2].1), "a stale token is refused");
        assert!(core.ack(0, batch[0].1));
        assert_eq!(release(&mut core, 10).iter().map(|d| d.0).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(core.ready_keys(), Vec::<&QueueKey>::new());
    }
}
