//! Node name → ledger slot, laid out for the per-candidate lookups of filter and
//! prioritize (thousands per request).
//!
//! A `HashMap<String, _>` keeps every key in its own heap allocation, so each lookup
//! misses the cache once for the table and once more for the key's bytes; at 5,000
//! candidates per request those misses were a quarter of filter's time. Here the
//! names sit back to back in one arena and the open-addressing table holds only
//! small indices, so the whole index of a 5,000-node cluster is a few hundred KiB.
//! Lookups are exact (the name is compared byte for byte).

/// Where a known node stands, as far as a lookup needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Located {
    /// Ledger index.
    pub slot: u32,
    /// The node has a usable inventory, advertises its GPUs and has a ledger slot:
    /// it may take pods. Otherwise the caller asks the full node entry why not.
    pub ready: bool,
    /// Some of its GPUs are unhealthy.
    pub unhealthy: bool,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    hash: u64,
    start: u32,
    len: u32,
    located: Located,
}

/// The index. Built whole with [`NameIndex::build`]; entries' [`Located`] can be
/// updated in place.
#[derive(Debug, Clone, Default)]
pub struct NameIndex {
    /// Power-of-two open-addressing table of entry index + 1 (0: empty).
    table: Vec<u32>,
    entries: Vec<Entry>,
    arena: String,
}

/// FNV-1a with a multiply-xorshift finaliser (splitmix64's), so that the low bits
/// (the table index) depend on every byte. Node names come from the API server.
pub fn name_hash(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in name.as_bytes() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h = (h ^ (h >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h = (h ^ (h >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

impl NameIndex {
    /// An index over `nodes` (a name given twice keeps its first entry).
    pub fn build<'a>(nodes: impl IntoIterator<Item = (&'a str, Located)>) -> Self {
        let mut index = NameIndex::default();
        let nodes: Vec<(&str, Located)> = nodes.into_iter().collect();
        let size = (nodes.len() * 2).next_power_of_two().max(8);
        index.table = vec![0; size];
        index
            .arena
            .reserve(nodes.iter().map(|(n, _)| n.len()).sum());
        for (name, located) in nodes {
            if index.get(name).is_some() {
                continue;
            }
            let (Ok(start), Ok(len), Ok(id)) = (
                u32::try_from(index.arena.len()),
                u32::try_from(name.len()),
                u32::try_from(index.entries.len() + 1),
            ) else {
                // Past 4 GiB of names: unreachable for a real cluster; such a node is
                // simply not indexed and the caller's slow path answers for it.
                continue;
            };
            let hash = name_hash(name);
            index.arena.push_str(name);
            index.entries.push(Entry {
                hash,
                start,
                len,
                located,
            });
            let mask = index.table.len() - 1;
            let mut i = (hash as usize) & mask;
            while index.table[i] != 0 {
                i = (i + 1) & mask;
            }
            index.table[i] = id;
        }
        index
    }

    fn find(&self, name: &str) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        let hash = name_hash(name);
        let mask = self.table.len() - 1;
        let mut i = (hash as usize) & mask;
        loop {
            let id = self.table[i];
            if id == 0 {
                return None;
            }
            let e = &self.entries[id as usize - 1];
            if e.hash == hash
                && self
                    .arena
                    .get(e.start as usize..(e.start + e.len) as usize)
                    .is_some_and(|s| s == name)
            {
                return Some(id as usize - 1);
            }
            i = (i + 1) & mask;
        }
    }

    /// The node called `name`, if indexed.
    #[must_use]
    pub fn get(&self, name: &str) -> Option<&Located> {
        self.find(name).map(|e| &self.entries[e].located)
    }

    /// Updates an indexed node's [`Located`]; false if `name` is not indexed.
    pub fn set(&mut self, name: &str, located: Located) -> bool {
        match self.find(name) {
            Some(e) => {
                self.entries[e].located = located;
                true
            }
            None => false,
        }
    }

    /// Number of indexed names.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(slot: u32) -> Located {
        Located {
            slot,
            ready: true,
            unhealthy: false,
        }
    }

    proptest! {
        /// Every indexed name is found with its own entry; other names are not found.
        #[test]
        fn finds_exactly_the_indexed_names(
            names in proptest::collection::hash_set("[a-z0-9-]{0,20}", 0..300),
            probes in proptest::collection::vec("[a-z0-9-]{0,20}", 0..50),
        ) {
            let names: Vec<String> = names.into_iter().collect();
            let index = NameIndex::build(
                names.iter().enumerate().map(|(i, n)| (n.as_str(), at(i as u32))),
            );
            prop_assert_eq!(index.len(), names.len());
            for (i, n) in names.iter().enumerate() {
                prop_assert_eq!(index.get(n), Some(&at(i as u32)));
            }
            for p in &probes {
                let expected = names.iter().position(|n| n == p).map(|i| at(i as u32));
                prop_assert_eq!(index.get(p).copied(), expected);
            }
        }
    }

    #[test]
    fn updates_in_place_and_keeps_the_first_of_duplicates() {
        let mut index = NameIndex::build([("a", at(0)), ("b", at(1)), ("a", at(7))]);
        assert_eq!(index.len(), 2);
        assert_eq!(index.get("a"), Some(&at(0)));
        let busy = Located {
            ready: false,
            ..at(1)
        };
        assert!(index.set("b", busy));
        assert_eq!(index.get("b"), Some(&busy));
        assert!(!index.set("c", busy));
        assert!(NameIndex::default().get("a").is_none());
    }
}
