//! The translator against a naive model, over random region sets, queries and hot changes.

use guestmem::{Guard, GuestAddress, GuestMap, RegionSpec, Thp, TranslateError};
use proptest::prelude::*;

/// The model: a list of (start, end) ranges, searched linearly.
fn model(regions: &[(u64, u64)], addr: u64, len: u64) -> Result<(u64, u64), TranslateError> {
    let end = addr
        .checked_add(len)
        .ok_or(TranslateError::Overflow { addr, len })?;
    let &(s, e) = regions
        .iter()
        .find(|&&(s, e)| s <= addr && addr < e)
        .ok_or(TranslateError::Unmapped { addr })?;
    if end > e {
        return Err(TranslateError::CrossesRegionEnd {
            addr,
            len,
            region_addr: s,
            region_end: e,
        });
    }
    Ok((s, addr - s))
}

#[derive(Debug, Clone)]
enum Op {
    Query(u64, u64),
    Add(u64, u64),
    Remove(usize),
}

fn spec(start: u64, size: u64) -> RegionSpec {
    RegionSpec::new(GuestAddress(start), size)
        .with_thp(Thp::Default)
        .with_guard(Guard::Off)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u64..(1 << 22), 0u64..0x6000).prop_map(|(a, l)| Op::Query(a, l)),
        1 => (u64::MAX - 0x4000..=u64::MAX, 0u64..0x8000).prop_map(|(a, l)| Op::Query(a, l)),
        2 => (0u64..1024, 1u64..8).prop_map(|(p, n)| Op::Add(p << 12, n << 12)),
        1 => (0usize..64).prop_map(Op::Remove),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]
    #[test]
    fn translator_matches_model(
        initial in prop::collection::vec((0u64..1024, 1u64..16), 0..12),
        ops in prop::collection::vec(op(), 1..200),
    ) {
        // Build a non-overlapping initial set from (page, pages) pairs by dropping overlaps.
        let mut regions: Vec<(u64, u64)> = Vec::new();
        for (p, n) in initial {
            let (s, e) = (p << 12, (p + n) << 12);
            if regions.iter().all(|&(rs, re)| e <= rs || s >= re) {
                regions.push((s, e));
            }
        }
        let specs: Vec<RegionSpec> = regions.iter().map(|&(s, e)| spec(s, e - s)).collect();
        let map = GuestMap::from_specs(&specs).unwrap();
        let mut t = map.translator();
        for op in ops {
            match op {
                Op::Query(addr, len) => {
                    let want = model(&regions, addr, len);
                    let got = t.translate(GuestAddress(addr), len as usize).map(|slice| {
                        let r = t.find(GuestAddress(addr)).unwrap();
                        (r.guest_addr().0, slice.ptr_guard().as_ptr() as u64 - r.host_addr() as u64)
                    });
                    prop_assert_eq!(&got, &want, "query {:#x}+{:#x}", addr, len);
                    // vm-memory's view through the cache agrees on the region.
                    let via_vmm = t.find_region(GuestAddress(addr))
                        .map(|r| r.guest_addr().0);
                    let model_region = regions.iter().find(|&&(s, e)| s <= addr && addr < e).map(|r| r.0);
                    prop_assert_eq!(via_vmm, model_region);
                }
                Op::Add(start, size) => {
                    let end = start + size;
                    let fits = regions.iter().all(|&(s, e)| end <= s || start >= e);
                    let res = map.add(&spec(start, size));
                    prop_assert_eq!(res.is_ok(), fits);
                    if fits {
                        regions.push((start, end));
                    }
                    t.refresh();
                }
                Op::Remove(i) => {
                    if regions.is_empty() {
                        continue;
                    }
                    let (s, _) = regions.remove(i % regions.len());
                    map.remove(GuestAddress(s)).unwrap();
                    t.refresh();
                }
            }
        }
    }
}
