//! The Redis commands of a partition's packed state ops, grouped into runs for `apply.lua`.
//!
//! Ops are packed `"<letter>,<offset>,<value>;"` each (`ops.rs`; the letters are `OpKind`'s in
//! `ordering_layer/state/store.py`). What each op writes to the partition's keys (`KEYS[2]` settled,
//! `KEYS[3]` attempts, `KEYS[4]` leases, `KEYS[5]` cascades, `KEYS[6]` firsts):
//!
//! | op | writes |
//! |---|---|
//! | `d` DELIVERED | HSET attempts offset value |
//! | `r` RELEASED | HSET attempts offset -value |
//! | `l` LEASE | HSET leases offset value |
//! | `b` BATCH_LEASE | nothing: the lease (value) of the batch ops after it |
//! | `e` BATCH_DELIVERED | HSET attempts offset value; HSET leases offset (the batch lease) |
//! | `q` BATCH_RELEASED | HSET attempts offset -value; HSET leases offset (the batch lease) |
//! | `D` FIRST_DELIVERED, `R` FIRST_RELEASED | a first attempt (value 1): ZADD firsts, see below |
//! | `E`, `Q` BATCH_FIRST_DELIVERED, BATCH_FIRST_RELEASED | the same; HSET leases offset (the batch lease) |
//! | `s` STARTED | HSET attempts offset value |
//! | `a` SETTLED | ZADD settled offset offset, unless the batch's floor is above the offset; HDEL attempts offset unless the value has bit 2 (no field: the attempt is in a run); HDEL leases offset unless it has bit 1 (no lease was written) |
//! | `n` NACKED | HDEL leases offset; with a value above 0, HSET attempts offset value |
//! | `u` UNSETTLED | ZREM settled offset |
//! | `c` CASCADE_FROM | SADD cascades offset |
//! | `x` CASCADE_DONE | SREM cascades offset |
//! | `f` FLOOR | ZADD settled GT value `_`; ZREMRANGEBYSCORE settled -inf (value; ZREMRANGEBYSCORE firsts -inf (value |
//!
//! First attempts (`KEYS[6]` firsts, a sorted set) are most of a busy partition's writes: a record
//! released for the first time gets no attempts field (a write, and a delete at its settle) but a
//! place in one member per batch and value (1 delivered, -1 released), which lists the batch's
//! stretches of consecutive offsets written with that value, `"<first>,<last>,...,<value>"`, scored
//! by its highest offset, added after the batch's other writes. Any later write of a record's
//! attempt goes to the attempts hash, which a claim reads before the runs; a member is dropped once
//! the floor passes its highest offset.
//!
//! The floor (the member `_` of the settled set, its score) is the partition's commit point:
//! everything below it is settled, so the set keeps only the offsets settled above it. A batch's
//! settles below its highest floor add nothing (the floor covers them), and nothing below a floor
//! is ever unsettled (`core/src/partition.rs`). `GT` keeps the floor from coming down when a batch
//! is applied again after a later one.
//!
//! Consecutive writes of one command to one key become one multi-field call: a key's run ends when
//! that key gets another command (or a FLOOR writes the settled set), so each key's writes keep
//! their order, and different keys are independent; the outcome is that of the ops one by one, with
//! a fraction of the calls. `apply.lua` gets the runs as a header (`"<key>,<COMMAND>;"` each) and one
//! MessagePack array of strings per run, which Redis's Lua unpacks in C (`cmsgpack`): parsing the
//! ops and building the argument tables inside Lua took about a third of the script's time.

use std::fmt::{self, Write};

/// The index in `apply.lua`'s KEYS of the settled set, the attempts and leases hashes, the cascades set.
const SETTLED_KEY: usize = 2;
const ATTEMPTS_KEY: usize = 3;
const LEASES_KEY: usize = 4;
const CASCADES_KEY: usize = 5;
const FIRSTS_KEY: usize = 6;

/// Why packed ops could not be encoded.
#[derive(Debug, PartialEq, Eq)]
pub enum OpsError {
    /// An op is not `"<letter>,<offset>,<value>;"` with a known letter and decimal integers.
    Malformed(String),
    /// A BATCH_DELIVERED or BATCH_RELEASED op came before any BATCH_LEASE.
    NoBatchLease(String),
}

impl fmt::Display for OpsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpsError::Malformed(op) => write!(f, "malformed state op {op:?}"),
            OpsError::NoBatchLease(op) => write!(f, "batch op {op:?} before any batch lease"),
        }
    }
}

/// One run being gathered: its command and its arguments, MessagePack-encoded as they come.
struct Run {
    command: &'static str,
    count: u32,
    items: Vec<u8>,
}

/// The runs of one batch of ops, in the order `apply.lua` must send them.
#[derive(Default)]
pub struct Runs {
    /// `"<key>,<COMMAND>;"` per run.
    pub header: String,
    /// One MessagePack array of strings per run: the command's arguments after its key.
    pub arguments: Vec<Vec<u8>>,
    open: [Option<Run>; 7],
}

impl Runs {
    /// Append `items` to the key's run of `command` (a new run when the key's open run is another
    /// command's); an item is a prefix and the rest of one string (`("-", "3")` is `"-3"`).
    fn add(&mut self, key: usize, command: &'static str, items: &[(&str, &str)]) {
        if self.open[key].as_ref().is_some_and(|run| run.command != command) {
            self.close(key);
        }
        let run = self.open[key].get_or_insert_with(|| Run { command, count: 0, items: Vec::new() });
        for (prefix, rest) in items {
            // Writing into a Vec cannot fail.
            let _ = rmp::encode::write_str_len(&mut run.items, (prefix.len() + rest.len()) as u32);
            run.items.extend_from_slice(prefix.as_bytes());
            run.items.extend_from_slice(rest.as_bytes());
        }
        run.count += items.len() as u32;
    }

    fn close(&mut self, key: usize) {
        if let Some(run) = self.open[key].take() {
            self.emit(key, run.command, run.count, &run.items);
        }
    }

    fn emit(&mut self, key: usize, command: &str, count: u32, items: &[u8]) {
        let mut encoded = Vec::with_capacity(items.len() + 5);
        let _ = rmp::encode::write_array_len(&mut encoded, count);
        encoded.extend_from_slice(items);
        let _ = write!(self.header, "{key},{command};"); // writing into a String cannot fail
        self.arguments.push(encoded);
    }
}

/// Group packed ops into the runs `apply.lua` sends (see the module's text).
pub fn group(packed: &str) -> Result<Runs, OpsError> {
    let mut runs = Runs::default();
    let floor = highest_floor(packed);
    let mut batch_lease: Option<&str> = None;
    let mut firsts = Firsts::default();
    let mut rest = packed;
    while !rest.is_empty() {
        let end = position(rest, 0, b';').ok_or_else(|| OpsError::Malformed(rest.to_owned()))?;
        let op = &rest[..end];
        rest = &rest[end + 1..];
        let malformed = || OpsError::Malformed(op.to_owned());
        let (kind, offset, value) = fields(op).ok_or_else(malformed)?;
        if !is_decimal(offset) || !is_decimal(value) {
            return Err(malformed());
        }
        let lease = || batch_lease.ok_or_else(|| OpsError::NoBatchLease(op.to_owned()));
        let first = |offsets: &mut Vec<i64>| {
            if value != "1" {
                return Err(malformed());
            }
            offsets.push(offset.parse().map_err(|_| malformed())?);
            Ok(())
        };
        match kind {
            "D" => first(&mut firsts.delivered)?,
            "R" => first(&mut firsts.released)?,
            "E" | "Q" => {
                let lease = lease()?;
                first(if kind == "E" { &mut firsts.delivered } else { &mut firsts.released })?;
                runs.add(LEASES_KEY, "HSET", &[("", offset), ("", lease)]);
            }
            "d" | "s" => runs.add(ATTEMPTS_KEY, "HSET", &[("", offset), ("", value)]),
            "r" => runs.add(ATTEMPTS_KEY, "HSET", &[("", offset), ("-", value)]),
            "l" => runs.add(LEASES_KEY, "HSET", &[("", offset), ("", value)]),
            "b" => batch_lease = Some(value),
            "e" | "q" => {
                let lease = lease()?;
                let sign = if kind == "q" { "-" } else { "" };
                runs.add(ATTEMPTS_KEY, "HSET", &[("", offset), (sign, value)]);
                runs.add(LEASES_KEY, "HSET", &[("", offset), ("", lease)]);
            }
            "a" => {
                let bits: u8 = value.parse().ok().filter(|bits| *bits <= 3).ok_or_else(malformed)?;
                if !below(offset, floor) {
                    runs.add(SETTLED_KEY, "ZADD", &[("", offset), ("", offset)]);
                }
                if bits & 2 == 0 {
                    runs.add(ATTEMPTS_KEY, "HDEL", &[("", offset)]);
                }
                if bits & 1 == 0 {
                    runs.add(LEASES_KEY, "HDEL", &[("", offset)]);
                }
            }
            "n" => {
                runs.add(LEASES_KEY, "HDEL", &[("", offset)]);
                if value != "0" {
                    runs.add(ATTEMPTS_KEY, "HSET", &[("", offset), ("", value)]);
                }
            }
            "u" => runs.add(SETTLED_KEY, "ZREM", &[("", offset)]),
            "c" => runs.add(CASCADES_KEY, "SADD", &[("", offset)]),
            "x" => runs.add(CASCADES_KEY, "SREM", &[("", offset)]),
            "f" => {
                runs.close(SETTLED_KEY);
                runs.add(SETTLED_KEY, "ZADD", &[("", "GT"), ("", value), ("", FLOOR_MEMBER)]);
                runs.close(SETTLED_KEY);
                runs.add(SETTLED_KEY, "ZREMRANGEBYSCORE", &[("", "-inf"), ("(", value)]);
                runs.close(SETTLED_KEY);
                runs.add(FIRSTS_KEY, "ZREMRANGEBYSCORE", &[("", "-inf"), ("(", value)]);
                runs.close(FIRSTS_KEY);
            }
            _ => return Err(malformed()),
        }
    }
    for key in SETTLED_KEY..=CASCADES_KEY {
        runs.close(key);
    }
    firsts.add_to(&mut runs);
    Ok(runs)
}

/// The offsets of a batch's first attempts, as delivered (1) and as released (-1).
#[derive(Default)]
struct Firsts {
    delivered: Vec<i64>,
    released: Vec<i64>,
}

impl Firsts {
    /// One ZADD of the first-attempts set: for each value written, one member listing the batch's
    /// stretches of consecutive offsets, `"<first>,<last>,...,<first>,<last>,<value>"`, scored by
    /// its highest offset. A batch's first attempts are one element however scattered its offsets
    /// (a key's records among a hot key's): Redis's time per element, not per byte, is the cost.
    fn add_to(self, runs: &mut Runs) {
        let mut items: Vec<(String, String)> = Vec::new();
        for (mut offsets, value) in [(self.delivered, 1), (self.released, -1)] {
            offsets.sort_unstable();
            offsets.dedup();
            let Some(&highest) = offsets.last() else { continue };
            let mut member = String::new();
            for stretch in offsets.chunk_by(|a, b| b - a == 1) {
                let (first, last) = (stretch[0], stretch[stretch.len() - 1]);
                let _ = write!(member, "{first},{last},"); // writing into a String cannot fail
            }
            let _ = write!(member, "{value}");
            items.push((highest.to_string(), member));
        }
        if items.is_empty() {
            return;
        }
        let pairs: Vec<(&str, &str)> = items.iter().flat_map(|(score, member)| [("", score.as_str()), ("", member.as_str())]).collect();
        runs.add(FIRSTS_KEY, "ZADD", &pairs);
        runs.close(FIRSTS_KEY);
    }
}

/// The settled set's member whose score is the partition's floor (not an offset: readers skip it).
pub const FLOOR_MEMBER: &str = "_";

/// The highest value of the batch's FLOOR ops (as text; malformed ones are refused by `group`).
fn highest_floor(packed: &str) -> Option<&str> {
    let bytes = packed.as_bytes();
    let mut highest: Option<&str> = None;
    let mut from = 0;
    // `f` is only ever a FLOOR's letter: the other ops' letters differ, their fields are digits.
    while let Some(at) = position(packed, from, b'f') {
        from = at + 1;
        if (at > 0 && bytes[at - 1] != b';') || !packed[at..].starts_with("f,0,") {
            continue;
        }
        let start = at + 4;
        let Some(end) = position(packed, start, b';') else { break };
        let value = &packed[start..end];
        if is_decimal(value) && highest.is_none_or(|high| (value.len(), value) > (high.len(), high)) {
            highest = Some(value);
        }
    }
    highest
}

/// Where the next ASCII `byte` is in `text` at or after `from` (a plain loop: the ops' fields are
/// a few bytes long, too short for a vectorised search to pay for its setup).
fn position(text: &str, from: usize, byte: u8) -> Option<usize> {
    text.as_bytes()[from..].iter().position(|&each| each == byte).map(|at| from + at)
}

/// An op's letter, offset and value (`"<letter>,<offset>,<value>"`); None without two commas.
fn fields(op: &str) -> Option<(&str, &str, &str)> {
    let first = position(op, 0, b',')?;
    let second = position(op, first + 1, b',')?;
    Some((&op[..first], &op[first + 1..second], &op[second + 1..]))
}

/// `offset` (decimal text) is below `floor` (decimal text without leading zeros, as Rust writes it).
fn below(offset: &str, floor: Option<&str>) -> bool {
    floor.is_some_and(|floor| (offset.len(), offset) < (floor.len(), floor))
}

/// A non-negative decimal integer (what the packed ops carry).
fn is_decimal(text: &str) -> bool {
    !text.is_empty() && text.len() <= 19 && text.bytes().all(|byte| byte.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs as (key, command, arguments), decoded.
    fn decoded(packed: &str) -> Vec<(String, Vec<String>)> {
        let runs = group(packed).expect("well-formed ops");
        let heads: Vec<&str> = runs.header.split(';').filter(|head| !head.is_empty()).collect();
        assert_eq!(heads.len(), runs.arguments.len());
        heads
            .iter()
            .zip(&runs.arguments)
            .map(|(head, encoded)| {
                let mut bytes = encoded.as_slice();
                let count = rmp::decode::read_array_len(&mut bytes).expect("an array");
                let items = (0..count)
                    .map(|_| {
                        let mut buffer = [0u8; 64];
                        rmp::decode::read_str(&mut bytes, &mut buffer).expect("a string").to_owned()
                    })
                    .collect();
                assert!(bytes.is_empty());
                ((*head).to_owned(), items)
            })
            .collect()
    }

    fn run(head: &str, items: &[&str]) -> (String, Vec<String>) {
        (head.to_owned(), items.iter().map(|item| (*item).to_owned()).collect())
    }

    #[test]
    fn a_release_and_its_settle_become_one_run_per_key_and_command() {
        let runs = decoded("b,0,900;q,5,1;q,7,2;s,5,1;a,5,0;a,7,0;");
        assert_eq!(
            runs,
            vec![
                run("3,HSET", &["5", "-1", "7", "-2", "5", "1"]),
                run("4,HSET", &["5", "900", "7", "900"]),
                run("2,ZADD", &["5", "5", "7", "7"]),
                run("3,HDEL", &["5", "7"]),
                run("4,HDEL", &["5", "7"]),
            ]
        );
    }

    #[test]
    fn a_settle_of_a_delivery_whose_lease_was_never_written_deletes_none() {
        let runs = decoded("a,5,1;a,6,0;");
        assert_eq!(
            runs,
            vec![run("2,ZADD", &["5", "5", "6", "6"]), run("3,HDEL", &["5", "6"]), run("4,HDEL", &["6"])]
        );
    }

    #[test]
    fn a_floor_covers_the_settles_below_it_and_trims_the_set() {
        let runs = decoded("a,3,0;a,12,0;f,0,4;a,9,0;u,9,0;c,9,0;x,2,0;n,11,0;n,12,3;d,13,1;l,13,77;f,0,10;");
        assert_eq!(
            runs,
            vec![
                run("2,ZADD", &["12", "12"]),
                run("2,ZADD", &["GT", "4", "_"]),
                run("2,ZREMRANGEBYSCORE", &["-inf", "(4"]),
                run("6,ZREMRANGEBYSCORE", &["-inf", "(4"]),
                run("5,SADD", &["9"]),
                run("3,HDEL", &["3", "12", "9"]),
                run("4,HDEL", &["3", "12", "9", "11", "12"]),
                run("2,ZREM", &["9"]),
                run("2,ZADD", &["GT", "10", "_"]),
                run("2,ZREMRANGEBYSCORE", &["-inf", "(10"]),
                run("6,ZREMRANGEBYSCORE", &["-inf", "(10"]),
                run("3,HSET", &["12", "3", "13", "1"]),
                run("4,HSET", &["13", "77"]),
                run("5,SREM", &["2"]),
            ]
        );
        assert_eq!(highest_floor("f,0,99;f,0,100;a,1000,0;"), Some("100"));
        assert_eq!(highest_floor("a,5,0;f,0,7;f,0,x;f,0,3;"), Some("7"));
        assert_eq!(highest_floor("a,5,0;u,6,0;"), None);
        assert_eq!(fields("e,12,3"), Some(("e", "12", "3")));
        assert_eq!((fields("e,12"), fields("e")), (None, None));
        assert!(below("99", Some("100")) && !below("100", Some("100")) && !below("5", None));
    }

    #[test]
    fn each_key_keeps_the_order_of_its_writes() {
        let runs = decoded("a,3,0;a,9,0;u,9,0;c,9,0;x,2,0;n,11,0;n,12,3;d,13,1;l,13,77;");
        assert_eq!(
            runs,
            vec![
                run("2,ZADD", &["3", "3", "9", "9"]),
                run("5,SADD", &["9"]),
                run("3,HDEL", &["3", "9"]),
                run("4,HDEL", &["3", "9", "11", "12"]),
                run("2,ZREM", &["9"]),
                run("3,HSET", &["12", "3", "13", "1"]),
                run("4,HSET", &["13", "77"]),
                run("5,SREM", &["2"]),
            ]
        );
    }

    #[test]
    fn first_attempts_become_one_member_per_value_listing_its_stretches() {
        let runs = decoded("D,7,1;D,5,1;R,9,1;D,6,1;R,10,1;D,12,1;b,0,900;E,13,1;Q,14,1;d,8,2;a,5,2;a,8,0;a,6,3;");
        assert_eq!(
            runs,
            vec![
                run("4,HSET", &["13", "900", "14", "900"]),
                run("3,HSET", &["8", "2"]),
                run("2,ZADD", &["5", "5", "8", "8", "6", "6"]),
                run("3,HDEL", &["8"]),
                run("4,HDEL", &["5", "8"]),
                run("6,ZADD", &["13", "5,7,12,13,1", "14", "9,10,14,14,-1"]),
            ]
        );
    }

    #[test]
    fn a_floor_drops_the_first_attempt_stretches_below_it() {
        let runs = decoded("D,3,1;f,0,10;");
        assert_eq!(
            runs,
            vec![
                run("2,ZADD", &["GT", "10", "_"]),
                run("2,ZREMRANGEBYSCORE", &["-inf", "(10"]),
                run("6,ZREMRANGEBYSCORE", &["-inf", "(10"]),
                run("6,ZADD", &["3", "3,3,1"]),
            ]
        );
    }

    #[test]
    fn nothing_queued_is_no_run() {
        let runs = group("").expect("no ops");
        assert!(runs.header.is_empty() && runs.arguments.is_empty());
    }

    #[test]
    fn malformed_ops_and_batch_ops_without_a_lease_are_refused() {
        assert_eq!(group("z,1,1;").err(), Some(OpsError::Malformed("z,1,1".into())));
        assert_eq!(group("a,1;").err(), Some(OpsError::Malformed("a,1".into())));
        assert_eq!(group("a,-1,0;").err(), Some(OpsError::Malformed("a,-1,0".into())));
        assert_eq!(group("a,1,0").err(), Some(OpsError::Malformed("a,1,0".into())));
        assert_eq!(group("q,1,1;").err(), Some(OpsError::NoBatchLease("q,1,1".into())));
        assert_eq!(group("Q,1,1;").err(), Some(OpsError::NoBatchLease("Q,1,1".into())));
        assert_eq!(group("D,1,2;").err(), Some(OpsError::Malformed("D,1,2".into())));
        assert_eq!(group("a,1,4;").err(), Some(OpsError::Malformed("a,1,4".into())));
    }
}
