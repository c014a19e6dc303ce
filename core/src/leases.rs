//! Outstanding deliveries and their leases (ACK-1, ACK-2, ACK-3), for one engine.
//!
//! Every delivery handed out and not settled has a lease here: its partition, offset, token and
//! payload size, when it went out, its deadline and when it is looked at next. A delivery is named by
//! a *handle* (`generation << 32 | slot`): the slot is reused once the delivery is settled, given
//! back or dropped, with the generation bumped, so a handle kept by user code after that (a late
//! ack of a message given back since) names nothing (ACK-5). The engine's `Message` carries its
//! handle; a run of plain acks is settled here, in the partition's core too, without Python per
//! message.
//!
//! A due-time heap holds one watch per released batch (its deliveries share their deadline) and one
//! entry per lease watched alone since (a new deadline, an extension). Shortly before a deadline the
//! lease is extended by the p99 ack latency (a histogram of whole seconds, 10..600, as Pub/Sub's
//! client keeps), clamped, unless it has been held for `max_lease_duration`; at the deadline it
//! lapses and the coordinator gives the delivery back (SUB-4). Check times are jittered so that the
//! extensions of many leases do not all land on one step. With `track` off (a comparison setting)
//! no deadline is watched: leases neither lapse nor get extended.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap as StdHashMap, VecDeque};

use foldhash::{HashMap, HashMapExt};
use std::time::{SystemTime, UNIX_EPOCH};

pub const MIN_EXTENSION: u32 = 10;
pub const MAX_EXTENSION: u32 = 600;
const OBSERVATIONS_KEPT: usize = 100_000; // ack latencies kept for a metrics reader that does not come
const NO_WATCH: u32 = u32::MAX;

/// The subscription's lease settings (seconds; an extension bound of 0 is unset).
#[derive(Clone, Copy)]
pub struct LeaseSettings {
    pub ack_deadline: f64,
    pub max_lease_duration: f64,
    pub min_extension: f64,
    pub max_extension: f64,
    pub track: bool,
}

impl LeaseSettings {
    /// How long before a deadline the lease is extended.
    fn margin(&self) -> f64 {
        (self.ack_deadline / 5.0).min(2.0)
    }
}

/// One outstanding delivery.
#[derive(Clone, Copy)]
pub struct Lease {
    pub partition: i32,
    pub epoch: i64,
    pub offset: i64,
    pub token: u64,
    pub size: i64,
    pub first_delivery: f64,
    pub deadline: f64,
    pub wall_ms: i64, // the lease to write to Redis, epoch ms (0: none is written)
    pub written: bool, // its lease was queued for Redis (a lease write or an extension)
    check: f64,
    watch: u32, // the batch watch that looks at it, or NO_WATCH (watched alone, or not tracked)
}

struct Slot {
    generation: u32,
    lease: Option<Lease>,
}

/// The watch of one released batch: when it looks, its deliveries' slots and generations, and how
/// many of them it still looks at (outstanding and not watched alone since).
struct Watch {
    members: Vec<(u32, u32)>,
    live: u32,
}

#[derive(PartialEq, Eq, PartialOrd, Ord)]
enum Item {
    Watch(u32),
    Alone { slot: u32, generation: u32 },
}

/// A due-time heap entry: (check time as ordered bits, sequence, item).
type Due = Reverse<(u64, u64, Item)>;

/// Times are non-negative monotonic seconds, so their IEEE bits order as the numbers do.
fn time_bits(time: f64) -> u64 {
    time.max(0.0).to_bits()
}

/// Epoch milliseconds `seconds` from now (what Redis stores as a deadline).
pub fn wall_ms(seconds: f64) -> i64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |elapsed| elapsed.as_secs_f64());
    ((now + seconds) * 1000.0) as i64
}

/// An extension to write: the lease of `partition:offset` now ends at `wall_ms` (epoch ms).
pub struct Extension {
    pub partition: i32,
    pub offset: i64,
    pub wall_ms: i64,
}

/// The outstanding deliveries of one engine and their leases.
pub struct Leases {
    pub settings: LeaseSettings,
    slots: Vec<Slot>,
    free: Vec<u32>,
    by_offset: HashMap<(i32, i64), u32>, // each outstanding delivery's slot: as many entries as deliveries
    watches: Vec<Option<Watch>>,
    free_watches: Vec<u32>,
    heap: BinaryHeap<Due>,
    sequence: u64,
    pub bytes: i64,
    histogram: Vec<u64>, // ack latencies by whole second, MIN_EXTENSION..=MAX_EXTENSION
    histogram_total: u64,
    pub latencies: VecDeque<f64>,
    pub extensions: u64,
    pub lapses: u64,
    random: u64,
    unwritten: VecDeque<(f64, u64)>, // (admitted at, handle) of deliveries with a lease to write, oldest first
}

pub fn handle(slot: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(slot)
}

fn split(handle: u64) -> (u32, u32) {
    ((handle & 0xffff_ffff) as u32, (handle >> 32) as u32)
}

impl Leases {
    pub fn new(settings: LeaseSettings) -> Self {
        Leases {
            settings,
            slots: Vec::new(),
            free: Vec::new(),
            by_offset: HashMap::new(),
            watches: Vec::new(),
            free_watches: Vec::new(),
            heap: BinaryHeap::new(),
            sequence: 0,
            bytes: 0,
            histogram: vec![0; (MAX_EXTENSION + 1) as usize],
            histogram_total: 0,
            latencies: VecDeque::new(),
            extensions: 0,
            lapses: 0,
            random: 0x9e37_79b9_7f4a_7c15,
            unwritten: VecDeque::new(),
        }
    }

    /// A number in [0, 1) (xorshift; only for jitter).
    fn next_random(&mut self) -> f64 {
        let mut x = self.random;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.random = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }

    fn check_time(&mut self, deadline: f64) -> f64 {
        deadline - self.settings.margin() * (1.0 - 0.2 * self.next_random())
    }

    fn push_due(&mut self, check: f64, item: Item) {
        self.sequence += 1;
        self.heap.push(Reverse((time_bits(check), self.sequence, item)));
    }

    /// Start a batch's watch (None when leases are not tracked): its deliveries join it with `admit`
    /// and it is scheduled by `end_batch`.
    pub fn begin_batch(&mut self, now: f64) -> (f64, f64, u32) {
        let deadline = now + self.settings.ack_deadline;
        if !self.settings.track {
            return (deadline, 0.0, NO_WATCH);
        }
        let check = self.check_time(deadline);
        let watch = Watch { members: Vec::new(), live: 0 };
        let id = match self.free_watches.pop() {
            Some(id) => {
                self.watches[id as usize] = Some(watch);
                id
            }
            None => {
                self.watches.push(Some(watch));
                (self.watches.len() - 1) as u32
            }
        };
        (deadline, check, id)
    }

    pub fn end_batch(&mut self, batch: (f64, f64, u32)) {
        let (_, check, id) = batch;
        if id == NO_WATCH {
            return;
        }
        if self.watches[id as usize].as_ref().is_some_and(|watch| watch.members.is_empty()) {
            self.watches[id as usize] = None;
            self.free_watches.push(id);
            return;
        }
        self.push_due(check, Item::Watch(id));
    }

    /// Take a released delivery as outstanding, watched with its batch; `wall_ms` is the lease to
    /// write for it if it is still outstanding after its release's flush (0: none). Returns its
    /// handle.
    #[allow(clippy::too_many_arguments)] // one delivery's fields
    pub fn admit(&mut self, batch: (f64, f64, u32), partition: i32, epoch: i64, offset: i64, token: u64, size: i64,
                 now: f64, wall_ms: i64) -> u64 {
        let (deadline, check, watch) = batch;
        let lease = Lease {
            partition, epoch, offset, token, size, first_delivery: now, deadline, wall_ms, written: false, check, watch,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize].lease = Some(lease);
                slot
            }
            None => {
                self.slots.push(Slot { generation: 1, lease: Some(lease) });
                (self.slots.len() - 1) as u32
            }
        };
        let generation = self.slots[slot as usize].generation;
        if watch != NO_WATCH {
            let watch = self.watches[watch as usize].as_mut().expect("an open batch watch");
            watch.members.push((slot, generation));
            watch.live += 1;
        }
        if let Some(previous) = self.by_offset.insert((partition, offset), slot) {
            // A partition's offset is outstanding once at a time; a stale entry is dropped.
            if previous != slot {
                self.release_slot(previous);
            }
        }
        self.bytes += size;
        let handle = handle(slot, generation);
        if wall_ms > 0 {
            self.unwritten.push_back((now, handle));
        }
        handle
    }

    /// The lease a handle names while its delivery is outstanding and its lease not written yet.
    fn unwritten_lease(&mut self, handle: u64) -> Option<&mut Lease> {
        let (slot, generation) = split(handle);
        let entry = &mut self.slots[slot as usize];
        if entry.generation != generation {
            return None;
        }
        entry.lease.as_mut().filter(|lease| !lease.written)
    }

    /// The leases to write now (a flush begins): those of the deliveries admitted at `before` or
    /// earlier that are still outstanding and whose lease was not written yet, marked written.
    /// Deliveries settled sooner never have their lease in Redis: most are settled within a few
    /// flushes of their release (ACK-4 keeps the leases of deliveries held longer).
    pub fn due_lease_writes(&mut self, before: f64) -> Vec<Lease> {
        let mut due = Vec::new();
        while let Some(&(admitted, handle)) = self.unwritten.front() {
            if admitted > before {
                break;
            }
            self.unwritten.pop_front();
            if let Some(lease) = self.unwritten_lease(handle) {
                lease.written = true;
                due.push(*lease);
            }
        }
        due
    }

    /// When the oldest delivery whose lease may have to be written was admitted (those settled
    /// or written since are forgotten first).
    pub fn next_lease_write(&mut self) -> Option<f64> {
        while let Some(&(admitted, handle)) = self.unwritten.front() {
            if self.unwritten_lease(handle).is_some() {
                return Some(admitted);
            }
            self.unwritten.pop_front();
        }
        None
    }

    /// The lease a handle names, while its delivery is outstanding.
    pub fn get(&self, handle: u64) -> Option<&Lease> {
        let (slot, generation) = split(handle);
        let entry = self.slots.get(slot as usize)?;
        if entry.generation != generation {
            return None;
        }
        entry.lease.as_ref()
    }

    /// The handle of the delivery of `partition:offset` outstanding now.
    pub fn find(&self, partition: i32, offset: i64) -> Option<u64> {
        let slot = *self.by_offset.get(&(partition, offset))?;
        let entry = &self.slots[slot as usize];
        entry.lease.as_ref().map(|_| handle(slot, entry.generation))
    }

    fn unwatch(&mut self, lease: &mut Lease) {
        if lease.watch != NO_WATCH {
            if let Some(watch) = self.watches[lease.watch as usize].as_mut() {
                watch.live -= 1;
            }
            lease.watch = NO_WATCH;
        }
    }

    /// Forget the delivery in `slot` (its generation bumped: its handle names nothing from now on).
    fn release_slot(&mut self, slot: u32) -> Option<Lease> {
        let entry = &mut self.slots[slot as usize];
        let mut lease = entry.lease.take()?;
        entry.generation = entry.generation.wrapping_add(1).max(1);
        self.free.push(slot);
        if self.by_offset.get(&(lease.partition, lease.offset)) == Some(&slot) {
            self.by_offset.remove(&(lease.partition, lease.offset));
        }
        self.bytes -= lease.size;
        self.unwatch(&mut lease);
        Some(lease)
    }

    /// Forget a delivery (settled, given back or dropped); with `acked_at`, its ack latency feeds
    /// the p99 extension (ACK-2). None when the handle names nothing.
    pub fn pop(&mut self, handle: u64, acked_at: Option<f64>) -> Option<Lease> {
        self.get(handle)?;
        let lease = self.release_slot(split(handle).0)?;
        if let Some(now) = acked_at {
            self.observe(now - lease.first_delivery);
        }
        Some(lease)
    }

    fn observe(&mut self, seconds: f64) {
        let bucket = if seconds <= f64::from(MIN_EXTENSION) {
            MIN_EXTENSION
        } else {
            (seconds.ceil() as u32).min(MAX_EXTENSION)
        };
        self.histogram[bucket as usize] += 1;
        self.histogram_total += 1;
        if self.latencies.len() == OBSERVATIONS_KEPT {
            self.latencies.pop_front();
        }
        self.latencies.push_back(seconds);
    }

    /// The smallest bucket with at least `percent` % of the ack latencies at or below it (10 when
    /// none was observed).
    pub fn percentile(&self, percent: f64) -> u32 {
        if self.histogram_total == 0 {
            return MIN_EXTENSION;
        }
        let target = self.histogram_total as f64 * percent / 100.0;
        let mut seen = 0u64;
        for bucket in MIN_EXTENSION..=MAX_EXTENSION {
            seen += self.histogram[bucket as usize];
            if seen as f64 >= target {
                return bucket;
            }
        }
        MAX_EXTENSION
    }

    /// Length of the next extension: the p99 ack latency, clamped to the subscription's bounds
    /// (0: unset) and to 10..600 s.
    pub fn extension_seconds(&self) -> f64 {
        let mut seconds = f64::from(self.percentile(99.0));
        if self.settings.min_extension > 0.0 {
            seconds = seconds.max(self.settings.min_extension);
        }
        if self.settings.max_extension > 0.0 {
            seconds = seconds.min(self.settings.max_extension);
        }
        seconds.clamp(f64::from(MIN_EXTENSION), f64::from(MAX_EXTENSION))
    }

    /// `modify_ack_deadline` (ACK-3): the delivery's deadline is `seconds` from now, watched alone;
    /// returns it in epoch ms (None when the handle names nothing).
    pub fn set_deadline(&mut self, handle: u64, seconds: f64, now: f64) -> Option<i64> {
        self.get(handle)?;
        let slot = split(handle).0;
        self.with_lease(slot, |lease| {
            lease.deadline = now + seconds;
            lease.written = true;
        });
        self.watch_alone(slot, None);
        Some(wall_ms(seconds))
    }

    fn with_lease(&mut self, slot: u32, change: impl FnOnce(&mut Lease)) {
        if let Some(lease) = self.slots[slot as usize].lease.as_mut() {
            change(lease);
        }
    }

    /// Watch one lease alone from now on (its batch's watch no longer looks at it).
    fn watch_alone(&mut self, slot: u32, check: Option<f64>) {
        if !self.settings.track {
            return;
        }
        let Some(mut lease) = self.slots[slot as usize].lease else { return };
        self.unwatch(&mut lease);
        lease.check = match check {
            Some(check) => check,
            None => self.check_time(lease.deadline),
        };
        let generation = self.slots[slot as usize].generation;
        self.slots[slot as usize].lease = Some(lease);
        self.push_due(lease.check, Item::Alone { slot, generation });
    }

    /// A partition let go: its deliveries can no longer be acked here.
    pub fn drop_partition(&mut self, partition: i32) {
        let slots: Vec<u32> = self.by_offset.iter().filter(|((p, _), _)| *p == partition).map(|(_, &s)| s).collect();
        for slot in slots {
            self.release_slot(slot);
        }
    }

    /// Outstanding deliveries.
    pub fn count(&self) -> usize {
        self.by_offset.len()
    }

    /// Outstanding deliveries of these partitions.
    pub fn count_in(&self, partitions: &[i32]) -> usize {
        self.by_offset.keys().filter(|(p, _)| partitions.contains(p)).count()
    }

    /// When `expire` has something to look at next.
    pub fn next_check(&self) -> Option<f64> {
        self.heap.peek().map(|Reverse((bits, _, _))| f64::from_bits(*bits))
    }

    /// Extend the leases about to end (ACK-2) and take out those that lapsed (ACK-1): returns the
    /// extensions (for Redis) and the lapsed leases (already forgotten here).
    pub fn expire(&mut self, now: f64) -> (Vec<Extension>, Vec<Lease>) {
        let mut extended = Vec::new();
        let mut lapsed = Vec::new();
        let now_bits = time_bits(now);
        while self.heap.peek().is_some_and(|Reverse((bits, _, _))| *bits <= now_bits) {
            let Reverse((bits, _, item)) = self.heap.pop().expect("peeked");
            match item {
                Item::Watch(id) => {
                    let Some(watch) = self.watches[id as usize].take() else { continue };
                    self.free_watches.push(id);
                    if watch.live == 0 {
                        continue;
                    }
                    for (slot, generation) in watch.members {
                        let entry = &self.slots[slot as usize];
                        let looked = entry.generation == generation
                            && entry.lease.as_ref().is_some_and(|lease| lease.watch == id);
                        if looked {
                            self.with_lease(slot, |lease| lease.watch = NO_WATCH);
                            self.look(slot, now, &mut extended, &mut lapsed);
                        }
                    }
                }
                Item::Alone { slot, generation } => {
                    let entry = &self.slots[slot as usize];
                    let current = entry.generation == generation
                        && entry.lease.as_ref().is_some_and(|lease| lease.watch == NO_WATCH && time_bits(lease.check) == bits);
                    if current {
                        self.look(slot, now, &mut extended, &mut lapsed);
                    }
                }
            }
        }
        self.extensions += extended.len() as u64;
        self.lapses += lapsed.len() as u64;
        (extended, lapsed)
    }

    /// A lease's check came: extend it, take it out as lapsed, or watch it again at its deadline.
    fn look(&mut self, slot: u32, now: f64, extended: &mut Vec<Extension>, lapsed: &mut Vec<Lease>) {
        let Some(lease) = self.slots[slot as usize].lease else { return };
        let settings = self.settings;
        if lease.deadline - settings.margin() <= now && now < lease.deadline
            && now - lease.first_delivery < settings.max_lease_duration
        {
            let seconds = self.extension_seconds();
            self.with_lease(slot, |lease| {
                lease.deadline = now + seconds;
                lease.written = true;
            });
            extended.push(Extension { partition: lease.partition, offset: lease.offset, wall_ms: wall_ms(seconds) });
            self.watch_alone(slot, None);
        } else if now >= lease.deadline {
            if let Some(gone) = self.release_slot(slot) {
                lapsed.push(gone);
            }
        } else {
            self.watch_alone(slot, Some(lease.deadline));
        }
    }

    /// Per partition: its outstanding deliveries and the age of the oldest (for metrics).
    pub fn per_partition(&self, now: f64) -> StdHashMap<i32, (usize, f64)> {
        let mut per: StdHashMap<i32, (usize, f64)> = StdHashMap::new();
        for &slot in self.by_offset.values() {
            if let Some(lease) = &self.slots[slot as usize].lease {
                let entry = per.entry(lease.partition).or_insert((0, 0.0));
                entry.0 += 1;
                entry.1 = entry.1.max(now - lease.first_delivery);
            }
        }
        per
    }

    /// Memory kept per slot and watch, for tests: (slots, watches allocated).
    pub fn allocated(&self) -> (usize, usize) {
        (self.slots.len(), self.watches.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> LeaseSettings {
        LeaseSettings { ack_deadline: 10.0, max_lease_duration: 3600.0, min_extension: 0.0, max_extension: 0.0, track: true }
    }

    #[test]
    fn a_stale_handle_names_nothing() {
        let mut leases = Leases::new(settings());
        let batch = leases.begin_batch(0.0);
        let first = leases.admit(batch, 0, 1, 7, 1, 100, 0.0, 0);
        leases.end_batch(batch);
        assert!(leases.pop(first, Some(1.0)).is_some());
        let batch = leases.begin_batch(2.0);
        let second = leases.admit(batch, 0, 1, 7, 2, 100, 2.0, 0);
        leases.end_batch(batch);
        assert_ne!(first, second);
        assert!(leases.get(first).is_none() && leases.pop(first, None).is_none());
        assert_eq!(leases.find(0, 7), Some(second));
        assert_eq!((leases.count(), leases.bytes), (1, 100));
    }

    #[test]
    fn a_batch_lapses_unless_acked_and_an_extension_is_watched_alone() {
        let mut leases = Leases::new(settings());
        let batch = leases.begin_batch(0.0);
        let handles: Vec<u64> = (0..3).map(|offset| leases.admit(batch, 0, 1, offset, 1, 1, 0.0, 0)).collect();
        leases.end_batch(batch);
        leases.pop(handles[0], Some(1.0));
        // Before the deadline, within the margin: extended by the p99 (10 s) and watched alone.
        let (extended, lapsed) = leases.expire(9.5);
        assert_eq!((extended.len(), lapsed.len()), (2, 0));
        assert_eq!(leases.get(handles[1]).unwrap().deadline, 19.5);
        leases.pop(handles[1], None);
        let (extended, lapsed) = leases.expire(18.0);
        assert_eq!((extended.len(), lapsed.len()), (1, 0));
        assert_eq!(leases.get(handles[2]).unwrap().deadline, 28.0);
        let (_, lapsed) = leases.expire(40.0);
        assert_eq!(lapsed.iter().map(|lease| lease.offset).collect::<Vec<_>>(), vec![2]);
        assert_eq!((leases.count(), leases.bytes, leases.lapses), (0, 0, 1));
        assert!(leases.next_check().is_none());
    }

    #[test]
    fn a_lease_is_written_only_for_a_delivery_still_outstanding_when_due() {
        let mut leases = Leases::new(settings());
        let batch = leases.begin_batch(0.0);
        let handles: Vec<u64> = (0..4).map(|offset| leases.admit(batch, 0, 1, offset, 1, 1, 0.0, 900)).collect();
        leases.end_batch(batch);
        // Admitted at 0.0: nothing is due before then.
        assert!(leases.due_lease_writes(-0.1).is_empty() && leases.next_lease_write() == Some(0.0));
        leases.pop(handles[0], Some(0.1)); // settled first: its lease is never written
        leases.set_deadline(handles[1], 30.0, 0.1); // ACK-3 writes its lease itself
        let batch = leases.begin_batch(0.2);
        let later = leases.admit(batch, 0, 1, 9, 1, 1, 0.2, 950);
        leases.end_batch(batch);
        let due: Vec<(i64, i64)> = leases.due_lease_writes(0.1).iter().map(|lease| (lease.offset, lease.wall_ms)).collect();
        assert_eq!(due, vec![(2, 900), (3, 900)]);
        assert!(leases.get(handles[2]).unwrap().written && !leases.get(later).unwrap().written);
        assert_eq!(leases.next_lease_write(), Some(0.2));
        let due: Vec<i64> = leases.due_lease_writes(0.2).iter().map(|lease| lease.offset).collect();
        assert_eq!(due, vec![9]);
        assert!(leases.due_lease_writes(1.0).is_empty() && leases.next_lease_write().is_none());
    }
}
