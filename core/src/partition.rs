//! Dispatch state of one owned partition: per-key hold queues, release, settlement, cascade, recovery.
//!
//! The same semantics as `tests/model/partition.py` (`PartitionState`, the reference model), kept
//! operation for operation (tests/model/test_core.py drives both with the same random sequences):
//!
//! * a queue key is the record's ordering key when ordering is on and the key is not empty, else
//!   the record's offset (an unordered record queues alone);
//! * a key's queue holds its fetched records from its first unsettled one; the first `cursor`
//!   have been delivered since the key's last reset; a nack or lapse of one of them rewinds the
//!   cursor to it, so it and every later delivered record go out again in order (SUB-4);
//! * the ready keys are released oldest first (insertion order, as a Python dict keeps it): a key
//!   leaves the ready set when looked at and comes back on an ack, a nack or the end of a backoff;
//! * records settled before a crash are skipped at intake unless their key cascades (SUB-3);
//! * a record that was settled and goes out again in a cascade (a rewind over it, or a walk over
//!   it for a cascading key) is unsettled in Redis (`UNSETTLED`, queued before its release), so
//!   that an owner that crashes mid-cascade leaves the rest of the cascade to its successor (SUB-4);
//!   for the walk this holds only if every record settled before was taken before anything is
//!   released, so nothing is released while the walk lasts (up to the highest offset settled
//!   before), unless `end_walk` lets it (the fetch is held over a buffer limit meanwhile);
//! * from `end_walk` on, each cascading ordering key is marked in Redis by the offset it cascades from
//!   (`CASCADE_FROM`, queued before anything of the key is released) and the commit point stays at
//!   or below the lowest mark, so that an owner that crashes before the walk's end leaves its
//!   successor both the marks (`cascades`, from the claim) and the marked records: a record of a
//!   mark cascades its key even when settled, and the marks go (`CASCADE_DONE`) when a walk ends;
//! * records an earlier owner handed out and never settled get the attempts charged to them
//!   (ACK-6) and, with `suspects` (callback mode), are suspects; those charged `QUARANTINE_FROM`
//!   attempts or more go out alone and one at a time per partition (`Quarantine`, DLQ-3): a batch
//!   stops before a quarantined record that is not its first;
//! * the commit point is written to Redis with the partition's flushes as its *floor* (`FLOOR`,
//!   `queue_floor`): everything below it is settled, so the settled set keeps only the offsets
//!   settled above it, and a new owner skips the records below the floor it claims (`floor`) as it
//!   skips those below the committed offset. No record below the commit point can go out again (a
//!   cascade starts at an unsettled record and only unsettles records after it, and the commit
//!   point is held at the lowest cascade mark), so a floor never has to come down.
//!
//! Queues live in a slab (`slots`) so that the ready list, the quarantine's waiting list and the
//! outstanding offsets refer to them by index (see `key_queue`).

use std::collections::{BTreeSet, BinaryHeap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use foldhash::{HashMap, HashMapExt, HashSet};

pub use crate::key_queue::{Entry, KeyBytes, QueueKey};
use crate::key_queue::{KeyQueue, Quarantine, Wake, QUARANTINE_FROM};
use crate::moves::Moves;
use crate::ops::{self, OpBuffer};
use crate::tracker::OffsetTracker;

/// Delivery tokens, unique in the process: a stale token (a delivery of an earlier ownership or
/// before a redelivery) never matches a new one.
static TOKENS: AtomicU64 = AtomicU64::new(1);

/// How many records of a ready key one release may take: `base`, or when more are buffered for the
/// key, its `share` of them (a key far behind the others gets a longer run), at most `most`.
#[derive(Clone, Copy, Debug)]
pub struct PerKey {
    pub base: i64,
    pub share: f64,
    pub most: i64,
}

impl PerKey {
    /// The limit for a key with `buffered` records not yet released.
    fn of(&self, buffered: usize) -> i64 {
        let by_share = (buffered as f64 * self.share) as i64;
        self.base.max(by_share.min(self.most))
    }
}

impl From<i64> for PerKey {
    /// The same limit for every key.
    fn from(base: i64) -> Self {
        PerKey { base, share: 0.0, most: base }
    }
}

/// What `release_ready` handed out: count and payload bytes.
pub struct ReleaseTotals {
    pub count: usize,
    pub bytes: i64,
}

/// How released attempts are queued for Redis (`Dispatcher._admit`): as `DELIVERED` ops (handed to
/// a pull), or `RELEASED` when `pooled` (handed to the callback pool, user code not yet started);
/// with `lease_ms`, as one `BATCH_LEASE` and `BATCH_DELIVERED` or `BATCH_RELEASED` ops.
#[derive(Clone, Copy, Default)]
pub struct Admission {
    pub lease_ms: Option<i64>,
    pub pooled: bool,
}

/// Dispatch state of one partition; `T` is the caller's record object.
pub struct PartitionCore<T> {
    ordered: bool,
    tracker: OffsetTracker,
    slots: Vec<Option<KeyQueue<T>>>,
    free: Vec<u32>,
    by_key: HashMap<KeyBytes, u32>,
    by_offset: HashMap<i64, u32>,
    delivered: HashMap<i64, u32>, // outstanding offset -> slot of its queue
    ready: VecDeque<(u32, u64)>,
    stamps: u64,
    wakes: BinaryHeap<Wake>,
    wake_seq: u64,
    pub buffered: i64,
    /// Keys with a delivery outstanding (the release's share per key counts them, `Dispatcher`).
    pub busy: usize,
    settled_before: HashSet<i64>,
    horizon: i64,
    floor: i64,         // the claim's floor: every offset below it is settled (-1: none)
    floor_queued: i64,  // the highest FLOOR queued, or the claim's floor
    cascading: HashMap<QueueKey, i64>, // cascading key -> the offset it cascades from
    // Marks in Redis or queued for it: the claim's, whose records cascade their keys when taken
    // (an own mark's record was taken already: offsets are taken once), and own.
    marks: BTreeSet<i64>,
    walk_holds: bool,
    attempts_before: HashMap<i64, u32>,
    suspects: bool,
    quarantine: Quarantine,
    pub ops: OpBuffer,
    spare: Vec<VecDeque<Entry<T>>>, // emptied queues' record buffers, kept for new queues
    moves: Option<Box<Moves>>,      // keys moved in by a partition expansion (SUB-8), if any
    // Keys that moved away, with the count and offset below which their records here are settled
    // (durable marks of the keys' clearance, SUB-8), if any.
    departed: Option<Box<HashMap<KeyBytes, (u32, i64)>>>,
}

/// Emptied record buffers kept at most (each of at most `SPARE_CAPACITY` entries).
const SPARE_KEPT: usize = 4096;
const SPARE_CAPACITY: usize = 64;

impl<T> PartitionCore<T> {
    /// `settled_before` and `attempts_before` come from the claim (the recovery walk, ACK-6); with
    /// `suspects` the records charged attempts are suspects, quarantined from `QUARANTINE_FROM`.
    /// `start_offset` is where a seek restarted the partition: the commit point until records
    /// arrive, and nothing below it is taken. `cascades` are the marks of an earlier owner whose
    /// walk did not end (see the module's text). `floor` is the claim's floor: the records below it
    /// were settled before and are skipped.
    pub fn new(ordered: bool, settled_before: HashSet<i64>, attempts_before: HashMap<i64, u32>,
               suspects: bool, start_offset: Option<i64>, cascades: HashSet<i64>, floor: Option<i64>) -> Self {
        let floor = floor.unwrap_or(-1);
        let horizon = settled_before.iter().chain(cascades.iter()).copied().max().unwrap_or(-1);
        let marks = cascades.into_iter().collect();
        PartitionCore {
            ordered,
            tracker: OffsetTracker::starting_at(start_offset),
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
            busy: 0,
            settled_before,
            horizon,
            floor,
            floor_queued: floor,
            cascading: HashMap::new(),
            marks,
            walk_holds: true,
            attempts_before,
            suspects,
            quarantine: Quarantine::default(),
            ops: OpBuffer::default(),
            spare: Vec::new(),
            moves: None,
            departed: None,
        }
    }

    /// The commit point: the lowest unsettled offset, held at the lowest cascade mark.
    pub fn watermark(&self) -> Option<i64> {
        let watermark = self.tracker.watermark();
        match (watermark, self.marks.first()) {
            (Some(offset), Some(&mark)) => Some(offset.min(mark)),
            _ => watermark,
        }
    }

    /// Queue the commit point as the partition's floor in Redis (`FLOOR`) when it rose since the
    /// last one queued (a flush takes it after the ops that raised it).
    pub fn queue_floor(&mut self) {
        if let Some(watermark) = self.watermark() {
            if watermark > self.floor_queued {
                self.ops.push(ops::FLOOR, 0, watermark);
                self.floor_queued = watermark;
            }
        }
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
        let queue = KeyQueue::new(qkey.clone(), self.spare.pop().unwrap_or_default());
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
        if self.slots[slot as usize].as_ref().is_some_and(|q| q.ready_stamp == 0 && !q.held()) {
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
    #[cfg(test)]
    pub fn add(&mut self, offset: i64, key: Option<&[u8]>, size: i64, item: T) -> bool {
        self.add_published(offset, key, size, item, (0, 0))
    }

    /// `add` a record published under `published.0` partitions (0: unknown) at append time
    /// `published.1` (ms): read only while the partition has keys moved in (`has_moves`).
    pub fn add_published(&mut self, offset: i64, key: Option<&[u8]>, size: i64, item: T,
                         published: (u32, i64)) -> bool {
        if self.tracker.next_offset.is_some_and(|next| offset < next) {
            return false;
        }
        self.tracker.add(offset);
        if offset < self.floor || self.departed_settled(offset, key, published) {
            self.tracker.settle(offset);
            if self.horizon >= 0 && offset >= self.horizon {
                self.end_of_walk();
            }
            return false;
        }
        let mut settled_before = false; // settled before the claim, and goes out again in a cascade
        if offset <= self.horizon {
            let qkey = self.queue_key(offset, key);
            let settled = self.settled_before.contains(&offset);
            settled_before = settled;
            let cascades = self.cascading.contains_key(&qkey);
            let skipped = settled && !cascades && !self.marks.contains(&offset);
            if skipped {
                self.tracker.settle(offset);
            } else {
                if settled {
                    self.ops.push(ops::UNSETTLED, offset, 0);
                }
                // A record that queues alone (no ordering key) has no later records to cascade over.
                if !cascades && matches!(qkey, QueueKey::Key(_)) {
                    self.cascading.insert(qkey, offset);
                    if !self.walk_holds {
                        self.mark(offset);
                    }
                }
            }
            if offset == self.horizon {
                self.end_of_walk();
            }
            if skipped {
                return false;
            }
        } else if self.horizon >= 0 {
            self.end_of_walk();
        }
        // A record an earlier owner handed out has its attempt in Redis already (a field or a run), and
        // so has one that was settled before and goes out again: their attempts go to the hash.
        let (attempts, suspect, earlier) = match self.attempts_before.remove(&offset) {
            Some(charged) => (charged, self.suspects, true),
            None => (0, false, settled_before),
        };
        let quarantined = suspect && attempts >= QUARANTINE_FROM;
        let slot = self.slot_for(offset, key);
        let queue = self.slots[slot as usize].as_mut().expect("a live slot");
        queue.records.push_back(Entry {
            offset, size, attempts, suspect, quarantined, released: earlier, in_hash: earlier, token: 0, acked: false,
            item,
        });
        if let (Some(moves), QueueKey::Key(key), false) = (self.moves.as_deref_mut(), &queue.qkey, queue.moved) {
            if let Some(count) = moves.holds(key, published.0, published.1) {
                queue.moved = true;
                queue.moved_from = offset;
                moves.holding += 1;
                moves.held.push((key.clone(), count));
            }
        }
        let idle = queue.outstanding == 0 && !queue.backing_off && !queue.held();
        self.buffered += 1;
        if idle {
            self.mark_ready(slot);
        }
        true
    }

    /// Every record up to the highest offset settled before has been taken (or lies below the log's
    /// start): nothing more is skipped or cascades.
    fn end_of_walk(&mut self) {
        self.horizon = -1;
        self.settled_before.clear();
        self.cascading.clear();
        for mark in std::mem::take(&mut self.marks) {
            self.ops.push(ops::CASCADE_DONE, mark, 0);
        }
    }

    /// Mark in Redis that a key cascades from `offset` (unless marked already).
    fn mark(&mut self, offset: i64) {
        if self.marks.insert(offset) {
            self.ops.push(ops::CASCADE_FROM, offset, 0);
        }
    }

    /// Ready keys, at most (keys taken out of the ready set since, by a backoff or a settle, are
    /// counted until a release passes them); 0 while the recovery walk holds releases. O(1).
    /// Take the topic's count history (ascending counts with the time, in ms, from which each was
    /// in force) for this partition, `partition`: records of keys that lived in another partition
    /// under an earlier count hold their keys until cleared (SUB-8). Keys cleared under an earlier
    /// history are held again; keys held now stay held.
    pub fn set_moves(&mut self, partition: u32, counts: Vec<(u32, i64)>) {
        let holding = self.moves.as_ref().map_or(0, |moves| moves.holding);
        self.moves = Moves::new(partition, counts).map(Box::new);
        if let Some(moves) = self.moves.as_deref_mut() {
            moves.holding = holding;
        } else if holding > 0 {
            let keys: Vec<KeyBytes> = self.slots.iter().flatten().filter(|queue| queue.moved)
                .filter_map(|queue| match &queue.qkey { QueueKey::Key(key) => Some(key.clone()), _ => None }).collect();
            for key in keys {
                self.release_moved(&key);
            }
        }
    }

    /// Take the marks of keys that moved away from this partition: `(key, count, below)` says every
    /// record of `key` here at an offset below `below` published under a count below `count` was
    /// settled before its key was cleared in its new partition. Such records are skipped at intake,
    /// as records below the floor are: a Redis that lost its settled sets must not hand them out
    /// again after the key's later records went out from its new partition (SUB-4, SUB-8).
    pub fn set_departed(&mut self, marks: Vec<(KeyBytes, u32, i64)>) {
        self.departed = if marks.is_empty() {
            None
        } else {
            Some(Box::new(marks.into_iter().map(|(key, count, below)| (key, (count, below))).collect()))
        };
    }

    /// Whether a record is settled by a departed key's mark (`set_departed`).
    fn departed_settled(&self, offset: i64, key: Option<&[u8]>, published: (u32, i64)) -> bool {
        let (Some(departed), Some(key)) = (self.departed.as_deref(), key) else { return false };
        let Some(&(count, below)) = departed.get(key) else { return false };
        offset < below && self.moves.as_deref().map_or(published.0, |moves| moves.count_at(published.0, published.1))
            < count
    }

    /// Whether records are read for moved keys (`add_published`).
    pub fn has_moves(&self) -> bool {
        self.moves.is_some()
    }

    /// The keys held since the last call, with the count their record was published under.
    pub fn take_moved(&mut self) -> Vec<(KeyBytes, u32)> {
        self.moves.as_deref_mut().map(|moves| std::mem::take(&mut moves.held)).unwrap_or_default()
    }

    /// Keys held now for a move.
    pub fn moved_holding(&self) -> usize {
        self.moves.as_ref().map_or(0, |moves| moves.holding)
    }

    /// Every record of `key` published before its moved records in its old partitions is settled:
    /// release its queue and hold it no more.
    pub fn clear_moved(&mut self, key: &[u8]) {
        if let Some(moves) = self.moves.as_deref_mut() {
            moves.clear(key);
        }
        self.release_moved(key);
    }

    fn release_moved(&mut self, key: &[u8]) {
        let Some(slot) = self.by_key.get(key).copied() else { return };
        let queue = self.queue(slot);
        if !queue.moved {
            return;
        }
        queue.moved = false;
        let idle = queue.outstanding == 0 && !queue.backing_off;
        if let Some(moves) = self.moves.as_deref_mut() {
            moves.holding -= 1;
        }
        if idle {
            self.mark_ready(slot);
        }
    }

    pub fn ready_len(&self) -> usize {
        if self.walking() { 0 } else { self.ready.len() }
    }

    /// The recovery walk holds releases (see the module's text).
    pub fn walking(&self) -> bool {
        self.horizon >= 0 && self.walk_holds
    }

    /// Release during the walk from now on (the fetch is held over a buffer limit, so the walk
    /// might never end otherwise).
    /// The keys found cascading so far are marked, lowest offset first.
    pub fn end_walk(&mut self) {
        if !self.walk_holds {
            return;
        }
        self.walk_holds = false;
        if self.horizon >= 0 {
            let mut from: Vec<i64> = self.cascading.values().copied().collect();
            from.sort_unstable();
            for offset in from {
                self.mark(offset);
            }
        }
    }

    // -- release -----------------------------------------------------------------------------------

    /// Release from the ready keys, oldest first: up to `per_key` records of each (`PerKey`),
    /// `budget` records in all, and no further key once `byte_budget` payload bytes are used up. The
    /// keys looked at leave the ready set. A quarantined record goes out alone once no other is out
    /// (else its key waits in the quarantine), and a batch stops before one. `emit` sees each
    /// released record with its token; the attempts are queued as `written` says.
    pub fn release_ready(
        &mut self,
        now: f64,
        mut budget: i64,
        per_key: impl Into<PerKey>,
        mut byte_budget: i64,
        written: Admission,
        mut emit: impl FnMut(&Entry<T>, u64),
    ) -> ReleaseTotals {
        let per_key = per_key.into();
        let mut looked = 0;
        let mut totals = ReleaseTotals { count: 0, bytes: 0 };
        if self.walking() {
            return totals;
        }
        let mark = self.ops.mark();
        // (a later attempt, a record's first attempt: written as part of a run, `runs.rs`)
        let (released_kind, first_kind) = match written.lease_ms {
            Some(lease) => {
                self.ops.push(ops::BATCH_LEASE, 0, lease);
                if written.pooled {
                    (ops::BATCH_RELEASED, ops::BATCH_FIRST_RELEASED)
                } else {
                    (ops::BATCH_DELIVERED, ops::BATCH_FIRST_DELIVERED)
                }
            }
            None if written.pooled => (ops::RELEASED, ops::FIRST_RELEASED),
            None => (ops::DELIVERED, ops::FIRST_DELIVERED),
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
            let queue = self.slots[slot as usize].as_mut().expect("a ready slot");
            let mut limit = per_key.of(queue.records.len().saturating_sub(queue.cursor)).min(budget).max(0) as usize;
            queue.ready_stamp = 0;
            if queue.outstanding > 0 || now < queue.not_before || queue.cursor >= queue.records.len() || queue.held() {
                continue;
            }
            let held_from = if queue.moved { queue.moved_from } else { i64::MAX };
            let start = queue.cursor;
            let head = &queue.records[start];
            if head.quarantined {
                let offset = head.offset;
                if !self.quarantine.admit(slot, queue, offset) {
                    continue;
                }
                limit = 1;
            }
            let end = (start + limit).min(queue.records.len());
            let mut stop = start;
            for entry in queue.records.range_mut(start..end) {
                if (entry.quarantined && stop > start) || entry.offset >= held_from {
                    break;
                }
                stop += 1;
                let token = TOKENS.fetch_add(1, AtomicOrdering::Relaxed);
                entry.token = token;
                let kind = if entry.released || entry.attempts > 0 {
                    entry.in_hash = true;
                    released_kind
                } else {
                    first_kind
                };
                entry.released = true;
                entry.attempts += 1;
                self.delivered.insert(entry.offset, slot);
                self.ops.push(kind, entry.offset, i64::from(entry.attempts));
                byte_budget -= entry.size;
                totals.bytes += entry.size;
                emit(entry, token);
            }
            let released = stop - start;
            if released > 0 {
                self.busy += 1; // released only from keys with nothing outstanding (above)
            }
            queue.outstanding += released;
            queue.cursor = stop;
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

    /// Queue an op decided outside the core; one that writes an attempt (`STARTED`) to the attempts
    /// hash marks the outstanding record of `offset`, whose settle then deletes that field.
    pub fn push_op(&mut self, kind: char, offset: i64, value: i64) {
        if kind == ops::STARTED {
            if let Some(&slot) = self.delivered.get(&offset) {
                let queue = self.queue(slot);
                if let Some(index) = queue.index_of(offset) {
                    queue.records[index].in_hash = true;
                }
            }
        }
        self.ops.push(kind, offset, value);
    }

    /// Settle a delivery; false when the token is stale (redelivered since, or never issued).
    pub fn ack(&mut self, offset: i64, token: u64) -> bool {
        self.ack_leased(offset, token, true)
    }

    /// `ack`, its `SETTLED` op saying whether a lease of the delivery may be in Redis (`leased`:
    /// it is deleted; otherwise the op's value has bit 1 and no lease is deleted), and whether an
    /// attempts field may hold its attempt (bit 2 when none does: its attempt is in a run).
    pub fn ack_leased(&mut self, offset: i64, token: u64, leased: bool) -> bool {
        let Some((slot, index)) = self.outstanding(offset, token) else { return false };
        self.delivered.remove(&offset);
        let queue = self.queue(slot);
        let entry = &mut queue.records[index];
        entry.token = 0;
        entry.acked = true;
        queue.outstanding -= 1;
        queue.failures = 0;
        let idle = queue.outstanding == 0;
        let no_field = if entry.in_hash { 0 } else { ops::SETTLED_NO_ATTEMPT_FIELD };
        if idle {
            self.busy -= 1;
        }
        self.tracker.settle(offset);
        self.ops.push(ops::SETTLED, offset, no_field | if leased { 0 } else { ops::SETTLED_NO_LEASE });
        self.pop_settled(slot, offset);
        true
    }

    /// Settle a delivered record without an ack (dead-lettered: DLQ-2). Its settle op is queued
    /// even when the key's queue is gone. A record waiting to go out again (a rewind passed it while
    /// its dead letter was being written) leaves its queue: settled, it never goes out again.
    pub fn settle_dead_lettered(&mut self, offset: i64, key: Option<&[u8]>) {
        self.ops.push(ops::SETTLED, offset, 0);
        let Some(slot) = self.slot_of(&self.queue_key(offset, key)) else { return };
        let queue = self.queue(slot);
        let (mut was_outstanding, mut waiting, mut idle) = (false, false, false);
        if let Some(index) = queue.index_of(offset) {
            let entry = &mut queue.records[index];
            was_outstanding = entry.token != 0;
            waiting = !was_outstanding && index >= queue.cursor;
            if waiting {
                queue.records.remove(index);
            } else {
                entry.token = 0;
                entry.acked = true;
            }
            if was_outstanding {
                queue.outstanding -= 1;
                idle = queue.outstanding == 0;
            }
        }
        if idle {
            self.busy -= 1;
        }
        if waiting {
            self.buffered -= 1;
        }
        if was_outstanding {
            self.delivered.remove(&offset);
        }
        self.tracker.settle(offset);
        self.pop_settled(slot, offset);
    }

    /// The outstanding quarantined record is settled or given back: the oldest key waiting is
    /// ready again.
    fn end_quarantine(&mut self, offset: i64) {
        if self.quarantine.offset == Some(offset) {
            if let Some(slot) = self.quarantine.settled(&mut self.slots) {
                self.mark_ready(slot);
            }
        }
    }

    fn pop_settled(&mut self, slot: u32, offset: i64) {
        self.end_quarantine(offset);
        let queue = self.queue(slot);
        while queue.cursor > 0 && queue.records.front().is_some_and(|entry| entry.acked && entry.token == 0) {
            queue.records.pop_front();
            queue.cursor -= 1;
        }
        if !queue.records.is_empty() {
            if queue.outstanding == 0 && !queue.backing_off {
                self.mark_ready(slot);
            }
            return;
        }
        let queue = self.slots[slot as usize].take().expect("a live slot");
        if queue.moved {
            if let Some(moves) = self.moves.as_deref_mut() {
                moves.holding -= 1;
            }
        }
        match &queue.qkey {
            QueueKey::Key(key) => self.by_key.remove(key.as_slice()),
            QueueKey::Offset(offset) => self.by_offset.remove(offset),
        };
        self.free.push(slot);
        if self.spare.len() < SPARE_KEPT && queue.records.capacity() <= SPARE_CAPACITY {
            self.spare.push(queue.records);
        }
    }

    /// Give a delivery back (nack or lapsed lease): rewind its key to it (SUB-4) and back off the
    /// key (DLQ-1) by `backoff(failures in a row)`. Its `NACKED` op carries the attempt user code
    /// nacked, or 0 when the lease `lapsed` (no start is known). False when the token is stale.
    pub fn nack<E>(&mut self, offset: i64, token: u64, now: f64, lapsed: bool,
                   backoff: impl FnOnce(u32) -> Result<f64, E>) -> Result<bool, E> {
        let Some((slot, index)) = self.rewind(offset, token) else { return Ok(false) };
        let entry = &mut self.queue(slot).records[index];
        let attempt = if lapsed { 0 } else { i64::from(entry.attempts) };
        entry.in_hash |= !lapsed;
        self.ops.push(ops::NACKED, offset, attempt);
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
        let Some((slot, _)) = self.rewind(offset, token) else { return false };
        self.hold(slot, now, delay);
        true
    }

    /// Rewind the key of an outstanding delivery to it: (slot, index of its record). The acked
    /// records after it are unsettled in Redis: they go out again (SUB-4).
    fn rewind(&mut self, offset: i64, token: u64) -> Option<(u32, usize)> {
        let (slot, index) = self.outstanding(offset, token)?;
        let queue = self.slots[slot as usize].as_mut().expect("a live slot");
        // In callback mode (`suspects`) user code holds one delivery of a key at a time: the ones
        // released after the rewound one (a run handed to one worker) were never started, so their
        // attempts are taken back (DLQ-3).
        let unstarted_after = self.suspects;
        for (position, entry) in queue.records.range_mut(index..queue.cursor).enumerate() {
            if entry.token != 0 {
                entry.token = 0;
                queue.outstanding -= 1;
                self.delivered.remove(&entry.offset);
                if unstarted_after && position > 0 {
                    entry.attempts = entry.attempts.saturating_sub(1);
                }
            }
            if entry.acked {
                entry.acked = false;
                self.tracker.unsettle(entry.offset);
                self.ops.push(ops::UNSETTLED, entry.offset, 0);
            }
        }
        if queue.outstanding == 0 {
            self.busy -= 1;
        }
        self.buffered += (queue.cursor - index) as i64;
        queue.cursor = index;
        // A quarantined record goes out alone: its key has nothing else outstanding to rewind.
        self.end_quarantine(offset);
        Some((slot, index))
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
            .map(|&(slot, _)| self.qkey_of(slot))
            .collect()
    }

    /// The keys whose next record is quarantined, waiting for the outstanding one, oldest first
    /// (a scan: for tests and metrics).
    pub fn waiting_keys(&self) -> Vec<&QueueKey> {
        self.quarantine.waiting(&self.slots).map(|slot| self.qkey_of(slot)).collect()
    }

    /// The offset of the outstanding quarantined record, if one is out.
    pub fn quarantined(&self) -> Option<i64> {
        self.quarantine.offset
    }

    fn qkey_of(&self, slot: u32) -> &QueueKey {
        &self.slots[slot as usize].as_ref().expect("a live slot").qkey
    }
}

#[cfg(test)]
mod tests {
    use super::{Admission, PartitionCore, QueueKey};
    use foldhash::{HashMap, HashSet, HashSetExt};

    /// A released record: offset, token, attempt, suspect.
    type Out = (i64, u64, u32, bool);

    fn claimed(ordered: bool, keys: &[&[u8]], charged: &[(i64, u32)], suspects: bool) -> PartitionCore<()> {
        let mut core = PartitionCore::new(ordered, HashSet::new(), charged.iter().copied().collect::<HashMap<_, _>>(),
                                          suspects, None, HashSet::new(), None);
        for (offset, key) in keys.iter().enumerate() {
            assert!(core.add(offset as i64, Some(key), 1, ()));
        }
        core
    }

    fn state(ordered: bool, keys: &[&[u8]]) -> PartitionCore<()> {
        claimed(ordered, keys, &[], true)
    }

    fn release_as(core: &mut PartitionCore<()>, per_key: i64, written: Admission) -> Vec<Out> {
        let mut out = Vec::new();
        core.release_ready(0.0, 1_000, per_key, 1_000, written, |entry, token| {
            out.push((entry.offset, token, entry.attempts, entry.suspect));
        });
        out
    }

    fn release(core: &mut PartitionCore<()>, per_key: i64) -> Vec<Out> {
        release_as(core, per_key, Admission::default())
    }

    fn offsets(out: &[Out]) -> Vec<i64> {
        out.iter().map(|d| d.0).collect()
    }

    fn named(qkeys: Vec<&QueueKey>) -> Vec<&[u8]> {
        qkeys
            .into_iter()
            .map(|qkey| match qkey {
                QueueKey::Key(key) => key.as_ref(),
                QueueKey::Offset(_) => panic!("an ordering key"),
            })
            .collect()
    }

    fn no_backoff(_: u32) -> Result<f64, ()> {
        Ok(0.0)
    }

    #[test]
    fn a_moved_key_waits_until_cleared_and_unmoved_keys_never_wait() {
        use crate::moves::tests::partition_for;
        let keys: Vec<Vec<u8>> = (0..60).map(|k| format!("key-{k}").into_bytes()).collect();
        let here: Vec<&Vec<u8>> = keys.iter().filter(|key| partition_for(key, 6) == 2).collect();
        let (moved, stayed): (Vec<&Vec<u8>>, Vec<&Vec<u8>>) = here.iter().partition(|key| partition_for(key, 4) != 2);
        assert!(!moved.is_empty() && !stayed.is_empty());
        let mut core = state(true, &[]);
        core.set_moves(2, vec![(4, 0), (6, 1_000)]);
        let mut offset = 0;
        for round in 0..2 {
            for key in &here {
                assert!(core.add_published(offset, Some(key), 1, (), (6, 2_000 + round)));
                offset += 1;
            }
        }
        let out = release(&mut core, 1);
        assert_eq!(out.len(), stayed.len(), "unmoved keys go out at once, one record each");
        assert_eq!(core.moved_holding(), moved.len());
        let held = core.take_moved();
        assert_eq!(held.len(), moved.len(), "each moved key reported once");
        assert!(held.iter().all(|(_, count)| *count == 6) && core.take_moved().is_empty());
        core.clear_moved(moved[0]);
        assert_eq!(core.moved_holding(), moved.len() - 1);
        let out = release(&mut core, 1);
        assert_eq!(out.len(), 1, "the cleared key goes out, the others still wait");
        assert!(core.add_published(offset, Some(moved[0]), 1, (), (6, 3_000)));
        assert!(core.take_moved().is_empty(), "a cleared key is not held again");
        core.set_moves(2, vec![(4, 0)]);
        assert_eq!(core.moved_holding(), 0, "no history: nothing waits");
        assert_eq!(release(&mut core, 1).len(), moved.len() - 1);
    }

    /// A key that moved away and back (h % 12 = 6, h % 18 = 12, h % 24 = 6): its records of the first
    /// count go out of partition 6 while its record of the third count waits for partition 12; the
    /// hold starts at the first record that waits, never before it.
    #[test]
    fn a_hold_starts_at_the_record_that_waits() {
        use crate::moves::tests::partition_for;
        let key = (0..100_000).map(|k| format!("key-{k}").into_bytes())
            .find(|key| partition_for(key, 12) == 6 && partition_for(key, 18) == 12 && partition_for(key, 24) == 6)
            .expect("a key that moves away and back");
        let mut core = state(true, &[]);
        core.set_moves(6, vec![(12, 0), (18, 1_000), (24, 2_000)]);
        assert!(core.add_published(0, Some(&key), 1, (), (12, 10)));
        assert!(core.add_published(1, Some(&key), 1, (), (12, 20)));
        assert!(core.add_published(2, Some(&key), 1, (), (24, 2_500)));
        assert!(core.add_published(3, Some(&key), 1, (), (24, 2_600)));
        assert_eq!(core.moved_holding(), 1);
        let out = release(&mut core, 10);
        assert_eq!(offsets(&out), vec![0, 1], "the records before the hold go out, in one batch");
        assert!(core.ack(0, out[0].1) && core.ack(1, out[1].1));
        assert!(release(&mut core, 10).is_empty(), "the moved records wait");
        core.clear_moved(&key);
        assert_eq!(offsets(&release(&mut core, 10)), vec![2, 3]);
    }

    /// Callback mode (`suspects`): a key's run released to one worker, its first nacked: the ones
    /// after it were never started, so the rewind takes their attempts back; in pull mode they
    /// were handed to user code and keep them.
    #[test]
    fn a_rewind_in_callback_mode_takes_back_the_attempts_of_the_run_after_it() {
        for (callback_mode, second_attempt) in [(true, 1), (false, 2)] {
            let mut core = claimed(true, &[b"k", b"k", b"k"], &[], callback_mode);
            let out = release(&mut core, 10);
            assert_eq!(offsets(&out), vec![0, 1, 2]);
            assert!(core.nack(0, out[0].1, 0.0, false, no_backoff).unwrap());
            let attempts: Vec<u32> = release(&mut core, 10).iter().map(|out| out.2).collect();
            assert_eq!(attempts, vec![2, second_attempt, second_attempt], "callback mode {callback_mode}");
        }
    }

    /// `busy` counts the keys with a delivery outstanding: a release makes a key busy, its last
    /// outstanding delivery acked, nacked or dead-lettered makes it idle again.
    #[test]
    fn busy_counts_the_keys_with_a_delivery_outstanding() {
        let mut core = claimed(true, &[b"a", b"a", b"b", b"c"], &[], true);
        let out = release(&mut core, 10);
        assert_eq!(offsets(&out), vec![0, 1, 2, 3]);
        assert_eq!(core.busy, 3);
        assert!(core.ack(0, out[0].1));
        assert_eq!(core.busy, 3, "a's second record is still out");
        assert!(core.ack(1, out[1].1));
        assert!(core.nack(2, out[2].1, 0.0, false, no_backoff).unwrap());
        assert_eq!(core.busy, 1);
        core.settle_dead_lettered(3, Some(b"c"));
        assert_eq!(core.busy, 0);
        assert_eq!(offsets(&release(&mut core, 10)), vec![2]);
        assert_eq!(core.busy, 1);
    }

    /// A departed key's records below its mark, published under an earlier count, are settled at
    /// intake (a Redis that lost its settled set must not hand them out again); its later records,
    /// and other keys, go out.
    #[test]
    fn a_departed_key_is_skipped_below_its_mark_only() {
        let mut core = state(true, &[]);
        core.set_moves(1, vec![(2, 0), (4, 1_000)]);
        core.set_departed(vec![((&b"gone"[..]).into(), 4, 3)]);
        assert!(!core.add_published(0, Some(b"gone"), 1, (), (2, 10)));
        assert!(core.add_published(1, Some(b"stay"), 1, (), (2, 10)));
        assert!(!core.add_published(2, Some(b"gone"), 1, (), (0, 500)), "no header: the count at its time");
        assert!(core.add_published(3, Some(b"gone"), 1, (), (2, 1_500)), "at the mark: published later");
        let out = release(&mut core, 1);
        assert_eq!(offsets(&out), vec![1, 3]);
        assert!(core.ack(1, out[0].1) && core.ack(3, out[1].1));
        assert_eq!(core.watermark(), Some(4), "the skipped records are settled");
    }

    #[test]
    fn a_key_far_behind_takes_its_share_of_its_buffered_records() {
        use super::PerKey;
        // Key h has 12 records buffered, keys a and b one each.
        let mut keys: Vec<&[u8]> = vec![b"h"; 12];
        keys.extend([b"a" as &[u8], b"b"]);
        let mut core = state(true, &keys);
        let mut out = Vec::new();
        let per_key = PerKey { base: 2, share: 0.5, most: 4 };
        core.release_ready(0.0, 1_000, per_key, 1_000, Admission::default(), |entry, _| out.push(entry.offset));
        assert_eq!(out, vec![0, 1, 2, 3, 12, 13]); // h: half of 12, at most 4; a, b: the base
        assert_eq!(PerKey { base: 2, share: 0.5, most: 40 }.of(12), 6);
        assert_eq!(PerKey { base: 2, share: 0.1, most: 40 }.of(12), 2); // the base when the share is less
        assert_eq!(PerKey::from(3).of(1_000), 3);
    }

    #[test]
    fn one_outstanding_per_key_and_keys_independent() {
        let mut core = state(true, &[b"a", b"b", b"a", b"b", b"a"]);
        let first = release(&mut core, 1);
        assert_eq!(offsets(&first), vec![0, 1]);
        assert!(release(&mut core, 1).is_empty());
        assert!(core.ack(1, first[1].1));
        assert_eq!(offsets(&release(&mut core, 1)), vec![3]);
        assert!(core.ack(0, first[0].1));
        assert_eq!(offsets(&release(&mut core, 1)), vec![2]);
        assert_eq!(core.watermark(), Some(2));
        assert_eq!(core.ops.take(), "D,0,1;D,1,1;a,1,2;D,3,1;a,0,2;D,2,1;");
    }

    /// A walk ended early by a buffer limit marks the cascading keys, and holds the commit point at
    /// the lowest mark; a successor that claims after a crash cascades a marked key from its mark,
    /// though the mark's record and the rest of the key were settled meanwhile (SUB-4).
    #[test]
    fn a_walk_ended_early_marks_its_cascades_for_a_successor() {
        // 0: k unsettled (the cascade's start), 1: j settled, 2: k settled before the crash.
        let mut first = PartitionCore::new(true, [1, 2].into_iter().collect(), HashMap::default(), true, None,
                                           HashSet::new(), None);
        assert!(first.add(0, Some(b"k"), 1, ()));
        assert!(!first.add(1, Some(b"j"), 1, ()));
        first.end_walk();
        first.end_walk();
        assert_eq!(first.ops.take(), "c,0,0;", "marked once, before the release");
        let out = release(&mut first, 1);
        assert!(first.ack(0, out[0].1));
        assert_eq!(first.watermark(), Some(0), "held at the mark, not 2");
        // The owner crashed before offset 2 came: Redis has 0, 1, 2 settled and the mark 0.
        let mut next = PartitionCore::new(true, [0, 1, 2].into_iter().collect(), HashMap::default(), true, None,
                                          [0].into_iter().collect(), None);
        assert!(next.add(0, Some(b"k"), 1, ()), "the mark's record cascades its key, settled or not");
        assert!(!next.add(1, Some(b"j"), 1, ()));
        assert!(next.add(2, Some(b"k"), 1, ()));
        assert!(!next.walking());
        assert_eq!(next.ops.take(), "u,0,0;u,2,0;x,0,0;");
        assert_eq!(next.watermark(), Some(0));
        let again = release(&mut next, 1);
        assert!(next.ack(0, again[0].1));
        assert_eq!(offsets(&release(&mut next, 1)), vec![2]);
    }

    #[test]
    fn nack_rewinds_and_cascades() {
        let mut core = state(true, &[b"k", b"k", b"k"]);
        let batch = release(&mut core, 10);
        assert!(core.ack(2, batch[2].1));
        assert!(core.nack(1, batch[1].1, 0.0, false, no_backoff).unwrap());
        assert!(!core.ack(2, batch[2].1), "a stale token is refused");
        assert!(core.ack(0, batch[0].1));
        assert_eq!(offsets(&release(&mut core, 10)), vec![1, 2]);
        assert_eq!(core.ready_keys(), Vec::<&QueueKey>::new());
    }

    /// A record acked and then unsettled by a cascade holds the commit point again: the ack of the
    /// record the key rewound to does not carry the commit point (nor the floor) past it.
    #[test]
    fn a_cascade_holds_the_commit_point_below_what_it_unsettled() {
        let mut core = state(true, &[b"k", b"k", b"k"]);
        let batch = release(&mut core, 10);
        assert!(core.ack(1, batch[1].1) && core.ack(2, batch[2].1));
        assert!(core.nack(0, batch[0].1, 0.0, false, no_backoff).unwrap());
        let again = release(&mut core, 1);
        assert!(core.ack(0, again[0].1));
        assert_eq!(core.watermark(), Some(1), "1 and 2 go out again: not settled");
        core.queue_floor();
        assert!(core.ops.take().ends_with("f,0,1;"));
    }

    /// The floor: queued when the commit point rose, once; a claim's floor skips the records below
    /// it (settled before) and ends a walk whose horizon lies below it.
    #[test]
    fn the_floor_follows_the_commit_point_and_a_claim_skips_below_it() {
        let mut core = state(false, &[b"a", b"b", b"c"]);
        core.queue_floor();
        assert_eq!(core.ops.take(), "f,0,0;");
        let out = release(&mut core, 1);
        assert!(core.ack(1, out[1].1));
        core.ops.take();
        core.queue_floor();
        assert_eq!(core.ops.take(), "", "0 is outstanding: the commit point has not moved");
        assert!(core.ack(0, out[0].1));
        core.queue_floor();
        core.queue_floor();
        assert_eq!(core.ops.take(), "a,0,2;f,0,2;");
        let mut next = PartitionCore::new(true, [4].into_iter().collect(), HashMap::default(), true, None,
                                          HashSet::new(), Some(3));
        assert!(!next.add(0, Some(b"k"), 1, ()) && !next.add(2, Some(b"k"), 1, ()));
        assert!(next.walking() && next.add(3, Some(b"k"), 1, ()));
        assert!(!next.add(4, Some(b"j"), 1, ()) && !next.walking());
        assert_eq!(next.watermark(), Some(3));
        next.queue_floor();
        assert_eq!(next.ops.take(), "", "the claim's floor is in Redis already");
        let mut beyond = PartitionCore::<()>::new(true, [1].into_iter().collect(), HashMap::default(), true, None,
                                                  HashSet::new(), Some(5));
        assert!(!beyond.add(1, Some(b"k"), 1, ()) && !beyond.walking(), "a horizon below the floor ends the walk");
    }

    #[test]
    fn quarantined_suspects_go_out_one_at_a_time_and_hand_over_oldest_first() {
        let mut core = claimed(true, &[b"a", b"b", b"c", b"d"], &[(0, 2), (1, 3), (2, 2)], true);
        let first = release(&mut core, 1);
        assert_eq!(first.iter().map(|d| (d.0, d.2, d.3)).collect::<Vec<_>>(), vec![(0, 3, true), (3, 1, false)]);
        assert_eq!((core.quarantined(), named(core.waiting_keys())), (Some(0), vec![&b"b"[..], b"c"]));
        assert!(core.add(4, Some(b"c"), 1, ()));
        assert!(release(&mut core, 1).is_empty(), "c is looked at again and keeps its place");
        assert_eq!(named(core.waiting_keys()), vec![&b"b"[..], b"c"]);
        assert!(core.ack(0, first[0].1));
        assert_eq!(named(core.ready_keys()), vec![&b"b"[..]]);
        let b = release(&mut core, 1);
        assert_eq!(b.iter().map(|d| (d.0, d.2, d.3)).collect::<Vec<_>>(), vec![(1, 4, true)]);
        assert!(core.nack(1, b[0].1, 0.0, true, no_backoff).unwrap());
        assert_eq!(named(core.ready_keys()), vec![&b"c"[..], b"b"], "the waiting key first, then the rewound one");
        let c = release(&mut core, 1);
        assert_eq!(offsets(&c), vec![2]);
        assert_eq!((core.quarantined(), named(core.waiting_keys())), (Some(2), vec![&b"b"[..]]));
        assert!(core.requeue(2, c[0].1, 0.0, 0.0, true));
        assert_eq!(named(core.ready_keys()), vec![&b"b"[..], b"c"]);
        let again = release(&mut core, 1);
        assert_eq!(again.iter().map(|d| (d.0, d.2)).collect::<Vec<_>>(), vec![(1, 5)]);
        core.settle_dead_lettered(1, Some(b"b"));
        assert_eq!((core.quarantined(), named(core.ready_keys())), (None, vec![&b"c"[..]]));
        assert_eq!(core.ops.take(), "d,0,3;D,3,1;a,0,0;d,1,4;n,1,0;d,2,3;d,1,5;a,1,0;");
    }

    #[test]
    fn a_batch_stops_before_a_quarantined_suspect() {
        let mut core = claimed(true, &[&b"k"[..]; 5], &[(2, 2)], true);
        let head = release(&mut core, 10);
        assert_eq!(offsets(&head), vec![0, 1]);
        assert!(core.ack(0, head[0].1) && core.ack(1, head[1].1));
        let suspect = release(&mut core, 10);
        assert_eq!(suspect.iter().map(|d| (d.0, d.2, d.3)).collect::<Vec<_>>(), vec![(2, 3, true)]);
        assert!(core.ack(2, suspect[0].1));
        assert_eq!(offsets(&release(&mut core, 10)), vec![3, 4]);
    }

    #[test]
    fn suspects_of_one_crash_go_out_together() {
        let charged = [(0, 1), (1, 0), (2, 1), (3, 2), (4, 2)];
        let mut core = claimed(true, &[b"k", b"k", b"k", b"j", b"i"], &charged, true);
        let out = release(&mut core, 10);
        assert_eq!(out.iter().map(|d| (d.0, d.2, d.3)).collect::<Vec<_>>(),
                   vec![(0, 2, true), (1, 1, true), (2, 2, true), (3, 3, true)]);
        assert_eq!((core.quarantined(), named(core.waiting_keys())), (Some(3), vec![&b"i"[..]]));
    }

    #[test]
    fn without_suspects_charged_records_keep_their_attempts_only() {
        let mut core = claimed(true, &[b"k", b"k", b"k", b"j"], &[(1, 4), (3, 1)], false);
        let out = release(&mut core, 10);
        assert_eq!(out.iter().map(|d| (d.0, d.2, d.3)).collect::<Vec<_>>(),
                   vec![(0, 1, false), (1, 5, false), (2, 1, false), (3, 2, false)]);
        assert_eq!(core.quarantined(), None);
    }

    #[test]
    fn only_a_records_first_attempt_goes_to_a_run_and_a_settle_deletes_only_fields_written() {
        // 0 charged by an earlier owner, 1 and 2 fresh, 3 settled before and cascading (marked).
        let mut core = PartitionCore::new(true, [3].into_iter().collect(), [(0, 1)].into_iter().collect(), false,
                                          None, [3].into_iter().collect(), None);
        for (offset, key) in [(0, b"a"), (1, b"b"), (2, b"c"), (3, b"d")] {
            assert!(core.add(offset, Some(key), 1, ()));
        }
        let out = release(&mut core, 1);
        assert_eq!(core.ops.take(), "u,3,0;x,3,0;d,0,2;D,1,1;D,2,1;d,3,1;");
        // 1 is given back unseen and goes out again; 2 is started (a field) and then acked.
        assert!(core.requeue(1, out[1].1, 0.0, 0.0, true));
        core.push_op(crate::ops::STARTED, 2, 1);
        let again = release(&mut core, 1);
        assert_eq!(offsets(&again), vec![1]);
        for (offset, token) in [(0, out[0].1), (1, again[0].1), (2, out[2].1), (3, out[3].1)] {
            assert!(core.ack_leased(offset, token, false));
        }
        assert_eq!(core.ops.take(), "s,2,1;d,1,1;a,0,1;a,1,1;a,2,1;a,3,1;");
    }

    #[test]
    fn op_letters_follow_the_release_mode() {
        let mut core = claimed(false, &[b"", b"", b""], &[], true);
        let pooled = release_as(&mut core, 1, Admission { lease_ms: None, pooled: true });
        assert!(core.nack(0, pooled[0].1, 0.0, false, no_backoff).unwrap());
        release_as(&mut core, 1, Admission { lease_ms: Some(9), pooled: true });
        assert!(release_as(&mut core, 1, Admission { lease_ms: Some(9), pooled: false }).is_empty(),
                "nothing released: no batch lease either");
        assert_eq!(core.ops.take(), "R,0,1;R,1,1;R,2,1;n,0,1;b,0,9;q,0,2;");
    }
}
