//! Keys that a partition expansion moved into this partition (SUB-8).
//!
//! Kafka routes a key by `murmur2(key) % count`, so when a topic grows from c to c' most keys move:
//! the records a key got under c sit in its old partition p, the ones it gets under c' in its new
//! partition q. A record of q is *moved* when, for an earlier count c of the topic's history, its
//! key's partition under c is not q. Its key's queue is held (not released) from that record on
//! until the coordinator clears the key: every record of the key published under an earlier count
//! in its old partitions is settled. A cleared key is not held again, until the history changes.
//!
//! The count a record was published under is its `ol-partition-count` header, or, for records of
//! other producers, the count in force at its append time by the history.

use foldhash::{HashSet, HashSetExt};

use crate::key_queue::KeyBytes;

/// Kafka's `Utils.murmur2` (the default partitioner of the Java client and of the layer).
pub fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ (data.len() as u32);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M) ^ k;
    }
    let tail = chunks.remainder();
    if tail.len() == 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if !tail.is_empty() {
        h ^= u32::from(tail[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// The topic's count history as one partition sees it, and the keys it holds or cleared.
pub struct Moves {
    partition: u32,
    counts: Vec<(u32, i64)>, // ascending counts, each with the time (ms) from which it was in force
    cleared: HashSet<KeyBytes>,
    /// Keys held since the coordinator last took them, with the count their record was published under.
    pub held: Vec<(KeyBytes, u32)>,
    /// Keys held now.
    pub holding: usize,
}

impl Moves {
    /// None when the history has a single count: nothing ever moved.
    pub fn new(partition: u32, mut counts: Vec<(u32, i64)>) -> Option<Self> {
        counts.retain(|&(count, _)| count > 0);
        counts.sort_unstable();
        counts.dedup_by_key(|(count, _)| *count);
        if counts.len() < 2 {
            return None;
        }
        Some(Moves { partition, counts, cleared: HashSet::new(), held: Vec::new(), holding: 0 })
    }

    /// The count a record was published under: `published` (its header; 0 when it has none), else
    /// the latest count in force at its append time.
    pub fn count_at(&self, published: u32, timestamp_ms: i64) -> u32 {
        if published > 0 {
            return published;
        }
        self.counts.iter().rev().find(|&&(_, since)| since <= timestamp_ms).unwrap_or(&self.counts[0]).0
    }

    /// The counts the topic grew to, after its first.
    pub fn later(&self) -> impl Iterator<Item = u32> + '_ {
        self.counts.iter().skip(1).map(|&(count, _)| count)
    }

    /// Whether a record of `key` holds its key: Some(count it was published under) when the key
    /// lived in another partition under an earlier count and is not cleared.
    pub fn holds(&self, key: &[u8], published: u32, timestamp_ms: i64) -> Option<u32> {
        let count = self.count_at(published, timestamp_ms);
        if self.counts[0].0 >= count || self.cleared.contains(key) {
            return None;
        }
        let hash = murmur2(key) & 0x7fff_ffff;
        let moved = self.counts.iter().take_while(|&&(earlier, _)| earlier < count)
            .any(|&(earlier, _)| hash % earlier != self.partition);
        moved.then_some(count)
    }

    pub fn clear(&mut self, key: &[u8]) {
        self.cleared.insert(key.into());
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// The partition the default partitioner gives `key` among `count`.
    pub fn partition_for(key: &[u8], count: u32) -> u32 {
        (murmur2(key) & 0x7fff_ffff) % count
    }

    #[test]
    fn the_later_counts_are_those_after_the_first() {
        let moves = Moves::new(0, vec![(18, 5), (12, 0), (24, 9), (0, 1)]).expect("grown");
        assert_eq!(moves.later().collect::<Vec<_>>(), vec![18, 24]);
    }

    #[test]
    fn murmur2_matches_kafka() {
        // Values of Kafka's Utils.murmur2 (its UtilsTest), as unsigned.
        assert_eq!(murmur2(b"21") as i32, -973_932_308);
        assert_eq!(murmur2(b"foobar") as i32, -790_332_482);
        assert_eq!(murmur2(b"a-little-bit-long-string") as i32, -985_981_536);
        assert_eq!(murmur2(b"a-little-bit-longer-string") as i32, -1_486_304_829);
        assert_eq!(murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") as i32, -58_897_971);
        assert_eq!(murmur2(b"abc") as i32, 479_470_107);
    }

    #[test]
    fn only_keys_that_lived_elsewhere_under_an_earlier_count_hold() {
        let keys: Vec<Vec<u8>> = (0..200).map(|k| format!("key-{k}").into_bytes()).collect();
        for partition in 0..6u32 {
            let moves = Moves::new(partition, vec![(2, 0), (6, 1_000)]).expect("grown");
            for key in keys.iter().filter(|key| partition_for(key, 6) == partition) {
                let moved = partition_for(key, 2) != partition;
                assert_eq!(moves.holds(key, 6, 0).is_some(), moved);
                assert_eq!(moves.holds(key, 0, 1_500).is_some(), moved, "by append time");
                assert_eq!(moves.holds(key, 0, 500), None, "appended before the growth: count 2");
                assert_eq!(moves.holds(key, 2, 5_000), None, "published under the first count");
            }
        }
    }

    #[test]
    fn a_cleared_key_holds_no_more_and_a_single_count_moves_nothing() {
        assert!(Moves::new(0, vec![(3, 0)]).is_none());
        assert!(Moves::new(0, vec![(3, 0), (3, 5)]).is_none());
        let key = (0..).map(|k| format!("k{k}").into_bytes())
            .find(|key| partition_for(key, 3) == 0 && partition_for(key, 2) != 0).expect("a moved key");
        let mut moves = Moves::new(0, vec![(3, 10), (2, 0)]).expect("grown");
        assert_eq!(moves.holds(&key, 3, 0), Some(3));
        moves.clear(&key);
        assert_eq!(moves.holds(&key, 3, 0), None);
    }
}
