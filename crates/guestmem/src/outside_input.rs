//! Property tests over every parser of input from outside the process: a peer's handshake
//! JSON, `manifest.json`, working-set files, `/proc` texts (smaps, numa_maps, fdinfo, CPU
//! lists), layout files and sizes. Each random or mutated input must give `Ok` or a clear
//! error: never a panic, and never an allocation out of proportion to the input.

use proptest::prelude::*;
use std::path::Path;

use crate::serve::{parse_regions, WorkingSetFile, MAX_HANDSHAKE_BYTES, PAGE_SIZES};
use crate::snapshot::manifest::{parse_manifest, MAX_BLOCKS};
use crate::snapshot::MAX_PAGE_BLOCK_BYTES;

/// Numbers that sit on the edges parsers get wrong: zero, page sizes and their neighbours,
/// powers of two, and the top of the range.
fn edgy_u64() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(0u64),
        Just(1),
        Just(4095),
        Just(4096),
        Just(2 << 20),
        Just(1 << 30),
        Just(2 << 30),
        Just(1 << 47),
        Just(1 << 56),
        Just(u64::MAX - 4095),
        Just(u64::MAX),
        (0u32..64).prop_map(|s| 1u64 << s),
        any::<u64>(),
    ]
}

/// A manifest guestmem writes, as JSON.
fn valid_manifest() -> serde_json::Value {
    serde_json::json!({
        "format": "guestmem-snapshot",
        "version": 1,
        "id": "0123456789abcdef",
        "memory_file": "memory",
        "memory_bytes": 3 << 20,
        "block_bytes": 1 << 20,
        "regions": [
            {"guest_addr": 0, "size": 2 << 20, "file_offset": 0, "page_size": 4096, "backing": "anonymous"},
            {"guest_addr": 8 << 20, "size": 1 << 20, "file_offset": 2 << 20, "page_size": 4096, "backing": "memfd"}
        ],
        "blocks": [
            {"index": 0, "checksum": "00000000000000aa"},
            {"index": 2, "checksum": "00000000000000bb", "pages": [1, 0, 0, 0]}
        ],
        "working_set": [2, 0]
    })
}

/// Replaces the value at a path of `v` (object keys and array indices, as chosen by `picks`)
/// with `with`.
fn mutate(v: &mut serde_json::Value, picks: &[usize], with: serde_json::Value) {
    let Some((&p, rest)) = picks.split_first() else {
        *v = with;
        return;
    };
    match v {
        serde_json::Value::Object(m) if !m.is_empty() => {
            let k = m.keys().nth(p % m.len()).cloned().expect("non-empty");
            mutate(m.get_mut(&k).expect("a key of it"), rest, with)
        }
        serde_json::Value::Array(a) if !a.is_empty() => {
            let n = a.len();
            mutate(&mut a[p % n], rest, with)
        }
        _ => *v = with,
    }
}

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        edgy_u64().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        ".{0,24}".prop_map(serde_json::Value::from),
        Just(serde_json::Value::Null),
        Just(serde_json::json!([])),
        Just(serde_json::json!({})),
        prop::collection::vec(edgy_u64(), 0..5).prop_map(serde_json::Value::from),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn handshake_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_regions(&bytes);
    }

    #[test]
    fn handshake_regions_are_ok_only_when_they_hold_together(
        regions in prop::collection::vec(
            (edgy_u64(), edgy_u64(), edgy_u64(), prop::option::of(edgy_u64()), prop::option::of(edgy_u64())),
            0..6,
        )
    ) {
        let json: Vec<serde_json::Value> = regions
            .iter()
            .map(|(a, s, o, p, k)| {
                let mut v = serde_json::json!({"base_host_virt_addr": a, "size": s, "offset": o});
                if let Some(p) = p { v["page_size"] = (*p).into(); }
                if let Some(k) = k { v["page_size_kib"] = (*k).into(); }
                v
            })
            .collect();
        let text = serde_json::to_vec(&json).unwrap();
        prop_assert!(text.len() < MAX_HANDSHAKE_BYTES);
        if let Ok(out) = parse_regions(&text) {
            for r in &out {
                prop_assert!(PAGE_SIZES.contains(&r.page_size));
                prop_assert!(r.size > 0 && r.size % r.page_size == 0);
                prop_assert_eq!(r.base_host_virt_addr % r.page_size, 0);
                prop_assert!(r.base_host_virt_addr.checked_add(r.size).is_some());
                prop_assert!(r.offset.checked_add(r.size).is_some());
            }
            for (i, a) in out.iter().enumerate() {
                for b in &out[i + 1..] {
                    let apart = |x: u64, xs: u64, y: u64, ys: u64| x + xs <= y || y + ys <= x;
                    prop_assert!(apart(a.base_host_virt_addr, a.size, b.base_host_virt_addr, b.size));
                    prop_assert!(apart(a.offset, a.size, b.offset, b.size));
                }
            }
        }
    }

    #[test]
    fn manifest_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_manifest(&bytes, Path::new("manifest.json"));
    }

    #[test]
    fn mutated_manifests_are_ok_only_within_their_bounds(
        picks in prop::collection::vec(any::<usize>(), 1..5),
        with in json_value(),
    ) {
        let mut v = valid_manifest();
        mutate(&mut v, &picks, with);
        let text = serde_json::to_vec(&v).unwrap();
        if let Ok(m) = parse_manifest(&text, Path::new("manifest.json")) {
            prop_assert!(m.block_bytes.is_power_of_two() && m.block_bytes <= MAX_PAGE_BLOCK_BYTES);
            let total = m.total_blocks();
            prop_assert!(total <= MAX_BLOCKS);
            prop_assert!(m.blocks.iter().all(|b| b.index < total));
            prop_assert!(m.working_set.iter().all(|&w| w < total));
            prop_assert_eq!(m.memory_bytes, m.regions.iter().map(|r| r.size).sum::<u64>());
            prop_assert!(!m.memory_file.contains('/'));
        }
    }

    #[test]
    fn working_set_files_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = WorkingSetFile::parse(&bytes);
    }

    #[test]
    fn working_set_offsets_round_trip(offsets in prop::collection::vec(any::<u64>(), 0..64)) {
        let text = serde_json::to_vec(&serde_json::json!({
            "format": WorkingSetFile::FORMAT, "offsets": offsets
        })).unwrap();
        prop_assert_eq!(WorkingSetFile::parse(&text).unwrap(), offsets);
    }

    #[test]
    fn proc_texts_never_panic(
        lines in prop::collection::vec(
            prop_oneof![
                "[0-9a-f]{1,16}-[0-9a-f]{1,16} rw-p [0-9a-f]{1,8} 00:00 0 .{0,12}",
                "(Rss|AnonHugePages|Locked|KernelPageSize|Private_Hugetlb): +[0-9]{1,22} kB",
                "[0-9a-f]{1,16} (default|bind:0) (anon|file)=[0-9]{1,20} N[0-9]{1,3}=[0-9]{1,22} kernelpagesize_kB=[0-9]{1,22}",
                "API:\t[0-9a-f]{0,4}:[0-9a-fz]{0,20}:[0-9a-f]{0,20}",
                ".{0,40}",
            ],
            0..12,
        )
    ) {
        let text = lines.join("\n");
        let _ = crate::inspect::parse_smaps(&text);
        let _ = crate::inspect::parse_numa_maps(&text);
        let _ = crate::uffd::parse_fdinfo_features(&text);
    }

    #[test]
    fn cpu_lists_stay_bounded(text in "([0-9]{1,20}(-[0-9]{1,20})?,){0,4}[0-9]{0,20}") {
        let cpus = crate::host::read::parse_cpu_list(&text);
        prop_assert!(cpus.len() <= 5 * ((1 << 16) + 1));
    }

    #[test]
    fn sizes_never_panic_and_read_back(s in ".{0,24}", n in any::<u32>(), unit in 0usize..5) {
        let _ = crate::plan::parse_size(&s);
        let (suffix, shift) = [("", 0), ("K", 10), ("M", 20), ("G", 30), ("T", 40)][unit];
        prop_assert_eq!(
            crate::plan::parse_size(&format!("{n}{suffix}")).ok(),
            u64::from(n).checked_mul(1 << shift)
        );
    }

    #[test]
    fn layout_files_never_panic(
        entries in prop::collection::vec(
            (".{0,8}", ".{0,8}", prop::option::of("(anonymous|memfd|hugetlb-2M|file:.{0,8}|.{0,6})")),
            0..4,
        ),
        raw in ".{0,64}",
    ) {
        let json: Vec<serde_json::Value> = entries
            .iter()
            .map(|(a, s, b)| {
                let mut v = serde_json::json!({"addr": a, "size": s});
                if let Some(b) = b { v["backing"] = b.clone().into(); }
                v
            })
            .collect();
        let _ = crate::plan::parse_layout(&serde_json::to_string(&json).unwrap());
        let _ = crate::plan::parse_layout(&raw);
    }
}
