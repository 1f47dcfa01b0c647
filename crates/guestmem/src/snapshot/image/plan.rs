//! Where each block of an image comes from: a chain's pieces (each save's part of a block,
//! oldest first), or one layer's blocks held whole (a raw memory file, memory in the store).

use std::collections::BTreeMap;

/// Where each block's bytes come from: for a block some save holds, those saves' pieces,
/// oldest first (the first holds every page, or the block starts zero if it does not; each
/// later one the pages it lists); a block no save holds is absent and reads as zero.
#[derive(Debug)]
pub(crate) enum Plan {
    /// A chain's: sparse, so what it costs follows the manifests' records (capped by their
    /// size), not the blocks the layout claims.
    Chain(BTreeMap<u64, Vec<Piece>>),
    /// One layer that holds each block it holds whole (a raw memory file, memory in the
    /// store): a bit a block, not a map entry (an image of 262,144 blocks, 1 GiB in 4 KiB
    /// blocks, grew the process by 30.7-30.9 MB with a map entry each, 1.4-1.6 MB with
    /// this, most of that the file's data ranges read at the start).
    Whole {
        /// Bit `b % 64` of word `b / 64`: block `b` is held.
        held: Vec<u64>,
        /// Blocks held.
        count: u64,
    },
}

/// The plan of a block a [`Plan::Whole`] holds.
static WHOLE: [Piece; 1] = [Piece {
    layer: 0,
    pages: None,
    checksum: 0,
}];

impl Plan {
    /// A plan of one layer holding no block yet.
    pub(crate) fn whole() -> Plan {
        Plan::Whole {
            held: Vec::new(),
            count: 0,
        }
    }

    /// Marks `block` held whole by the one layer (a [`Plan::Whole`]).
    pub(crate) fn hold(&mut self, block: u64) {
        let Plan::Whole { held, count } = self else {
            unreachable!("only a plan of one layer is filled a block at a time");
        };
        let (w, bit) = ((block / 64) as usize, 1u64 << (block % 64));
        if held.len() <= w {
            held.resize(w + 1, 0);
        }
        if held[w] & bit == 0 {
            held[w] |= bit;
            *count += 1;
        }
    }

    /// `block`'s pieces, oldest first, if any save holds it.
    pub(crate) fn get(&self, block: u64) -> Option<&[Piece]> {
        match self {
            Plan::Chain(m) => m.get(&block).map(Vec::as_slice),
            Plan::Whole { held, .. } => held
                .get((block / 64) as usize)
                .is_some_and(|w| w & (1 << (block % 64)) != 0)
                .then_some(&WHOLE[..]),
        }
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> u64 {
        match self {
            Plan::Chain(m) => m.len() as u64,
            Plan::Whole { count, .. } => *count,
        }
    }
}

/// Resolves a chain's block records, oldest save first, into its [`Plan`]: a save that
/// holds a whole block replaces what was under it, one that holds some pages goes on top.
pub(crate) fn resolve_chain<'a>(
    layers: impl IntoIterator<Item = &'a [crate::snapshot::BlockRecord]>,
) -> Plan {
    let mut plan = BTreeMap::<u64, Vec<Piece>>::new();
    for (layer, records) in layers.into_iter().enumerate() {
        for rec in records {
            let piece = Piece {
                layer,
                pages: rec.pages.clone(),
                // Checked to be 16 hex digits when the manifest was read.
                checksum: u64::from_str_radix(&rec.checksum, 16).unwrap_or(0),
            };
            let slot = plan.entry(rec.index).or_default();
            if piece.pages.is_none() {
                slot.clear();
            }
            slot.push(piece);
        }
    }
    Plan::Chain(plan)
}

/// One save's part of a block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) layer: usize,
    pub(crate) pages: Option<Vec<u64>>,
    pub(crate) checksum: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::BlockRecord;

    fn rec(index: u64, pages: Option<Vec<u64>>) -> BlockRecord {
        BlockRecord {
            index,
            checksum: format!("{index:016x}"),
            pages,
        }
    }

    #[test]
    fn a_chain_resolves_whole_blocks_over_and_page_lists_on_top() {
        let base = [rec(0, None), rec(1, None)];
        let inc1 = [rec(1, Some(vec![1])), rec(2, Some(vec![2]))];
        let inc2 = [rec(1, None), rec(2, Some(vec![4]))];
        let Plan::Chain(plan) = resolve_chain([&base[..], &inc1[..], &inc2[..]]) else {
            panic!("a chain's plan");
        };
        let layers = |b: u64| -> Vec<usize> { plan[&b].iter().map(|p| p.layer).collect() };
        // Block 0: only the base holds it.
        assert_eq!(layers(0), [0]);
        // Block 1: the second incremental save holds it whole: what was under it goes.
        assert_eq!(layers(1), [2]);
        // Block 2: two page lists, oldest first, over zero.
        assert_eq!(layers(2), [1, 2]);
        assert_eq!(plan[&2][1].pages, Some(vec![4]));
        assert_eq!(plan[&2][0].checksum, 2);
        // Block 3: nobody holds it: absent, reads as zero.
        assert!(!plan.contains_key(&3));
    }

    #[test]
    fn an_empty_chain_plans_nothing() {
        let none: [&[BlockRecord]; 0] = [];
        assert_eq!(resolve_chain(none).len(), 0);
    }
}
