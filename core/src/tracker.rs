//! The commit point of one partition: the lowest fetched offset not settled (ACK-4).

use std::collections::VecDeque;

/// Fetched offsets (increasing) with a settled flag each; the settled prefix is dropped as it forms.
#[derive(Default)]
pub struct OffsetTracker {
    order: VecDeque<(i64, bool)>,
    pub next_offset: Option<i64>,
}

impl OffsetTracker {
    /// A tracker whose commit point is `start` until records arrive (after a seek), and which
    /// takes no offset below it.
    pub fn starting_at(start: Option<i64>) -> Self {
        OffsetTracker { order: VecDeque::new(), next_offset: start }
    }

    /// A fetched offset (offsets arrive in increasing order).
    pub fn add(&mut self, offset: i64) {
        self.order.push_back((offset, false));
        self.next_offset = Some(offset + 1);
    }

    /// An offset acked or dead-lettered (or skipped as settled before). Offsets that are not
    /// tracked (settled twice, never fetched) change nothing.
    pub fn settle(&mut self, offset: i64) {
        if let Ok(index) = self.order.binary_search_by_key(&offset, |entry| entry.0) {
            self.order[index].1 = true;
        }
        while matches!(self.order.front(), Some((_, true))) {
            self.order.pop_front();
        }
    }

    /// A settled offset goes out again (a cascade over it, SUB-4): the commit point stays below it
    /// until it is settled again. An offset of the settled prefix (already dropped) stays settled:
    /// a cascade only unsettles offsets above an outstanding one.
    pub fn unsettle(&mut self, offset: i64) {
        if let Ok(index) = self.order.binary_search_by_key(&offset, |entry| entry.0) {
            self.order[index].1 = false;
        }
    }

    /// The offset to commit: everything below it is settled. None before any fetch.
    pub fn watermark(&self) -> Option<i64> {
        self.order.front().map(|entry| entry.0).or(self.next_offset)
    }
}

#[cfg(test)]
mod tests {
    use super::OffsetTracker;

    #[test]
    fn commits_lowest_unsettled() {
        let mut tracker = OffsetTracker::default();
        assert_eq!(tracker.watermark(), None);
        for offset in [5, 6, 7, 9] {
            tracker.add(offset);
        }
        tracker.settle(6);
        tracker.settle(9);
        assert_eq!(tracker.watermark(), Some(5));
        tracker.settle(5);
        assert_eq!(tracker.watermark(), Some(7));
        tracker.settle(7);
        assert_eq!(tracker.watermark(), Some(10));
    }

    #[test]
    fn an_unsettled_offset_holds_the_commit_point_again() {
        let mut tracker = OffsetTracker::default();
        for offset in [5, 6, 7] {
            tracker.add(offset);
        }
        tracker.settle(6);
        tracker.unsettle(6);
        tracker.settle(5);
        assert_eq!(tracker.watermark(), Some(6));
        tracker.settle(6);
        tracker.settle(7);
        assert_eq!(tracker.watermark(), Some(8));
    }
}
