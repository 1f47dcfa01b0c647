//! The core map, layout and translator against what the kernel really holds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem::inspect::inspect_region;
use guestmem::vm_memory::Bytes;
use guestmem::{
    Backing, Guard, GuestAddress, GuestMap, MapError, RegionSpec, Thp, TranslateError, MAX_REGIONS,
};

fn serial() -> std::sync::MutexGuard<'static, ()> {
    guestmem_testkit::host_lock()
}

const MIB: u64 = 1 << 20;

fn host_bytes(r: &guestmem::Region, off: u64, len: usize) -> Vec<u8> {
    assert!(off + len as u64 <= r.size());
    // SAFETY: off..off+len lies inside the region (asserted above), which the caller keeps
    // mapped; the test is the only writer while this copy is taken.
    unsafe { std::slice::from_raw_parts(r.host_addr().add(off as usize), len).to_vec() }
}

fn thp_available() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false)
}

#[test]
fn every_backing_reads_and_writes_through_translator_and_bytes() {
    let _serial = serial();
    let file = std::env::temp_dir().join(format!("guestmem-core-{}", std::process::id()));
    std::fs::write(&file, vec![0u8; 3 * MIB as usize]).unwrap();
    let specs = [
        RegionSpec::new(GuestAddress(0), 4 * MIB),
        RegionSpec::new(GuestAddress(0x100_0000), 2 * MIB).with_backing(Backing::Memfd),
        RegionSpec::new(GuestAddress(0x200_0000 + 0x3000), MIB + 0x5000).with_thp(Thp::NoHuge),
        RegionSpec::new(GuestAddress(0x300_0000), 2 * MIB)
            .with_backing(Backing::File {
                path: file.clone(),
                offset: MIB,
            })
            .with_guard(Guard::Off),
    ];
    let map = GuestMap::from_specs(&specs).unwrap();
    std::fs::remove_file(&file).unwrap();
    let t = map.translator();
    let snap = map.view();
    for (i, r) in snap.regions().iter().enumerate() {
        let base = r.guest_addr().0;
        let last = base + r.size() - 8;
        let pattern = [i as u8 + 1; 8];
        // Translator writes land in the host mapping and show through vm-memory's Bytes.
        t.write_in_region(GuestAddress(base), &pattern).unwrap();
        t.write_in_region(GuestAddress(last), &pattern).unwrap();
        assert_eq!(host_bytes(r, 0, 8), pattern);
        assert_eq!(host_bytes(r, r.size() - 8, 8), pattern);
        let mut b = [0u8; 8];
        snap.read_slice(&mut b, GuestAddress(last)).unwrap();
        assert_eq!(b, pattern);
        // vm-memory writes show through the translator.
        let v: u64 = 0x1122_3344_5566_7700 | i as u64;
        snap.write_obj(v, GuestAddress(base + 0x800)).unwrap();
        let mut b = [0u8; 8];
        t.read_in_region(GuestAddress(base + 0x800), &mut b)
            .unwrap();
        assert_eq!(u64::from_le_bytes(b), v);
        // Host and guest addresses are congruent modulo the huge-page size.
        assert_eq!(r.host_addr() as u64 % r.huge_align(), base % r.huge_align());
    }
    // A memfd region's data is visible through its descriptor.
    let memfd = &snap.regions()[1];
    let mut b = [0u8; 8];
    let f = memfd.file_offset().unwrap().file();
    std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 0).unwrap();
    assert_eq!(b, [2u8; 8]);
    // vm-memory's cross-region access refuses holes like the translator does.
    assert!(snap
        .write_slice(&[0; 16], GuestAddress(0x40_0000 - 8))
        .is_err());
}

#[test]
fn from_specs_beyond_limit_is_refused_before_mapping() {
    let _serial = serial();
    let specs: Vec<RegionSpec> = (0..=MAX_REGIONS as u64)
        .map(|i| RegionSpec::new(GuestAddress(i << 12), 4096))
        .collect();
    let e = GuestMap::from_specs(&specs).unwrap_err();
    assert!(
        matches!(e, MapError::TooManyRegions { limit, .. } if limit == MAX_REGIONS),
        "{e}"
    );
}

#[test]
fn failed_from_specs_leaves_nothing_mapped() {
    let _serial = serial();
    // A size no other test uses, so its VMA can be told apart while tests run in parallel.
    const ODD_SIZE: u64 = 6 * MIB + 3 * 4096;
    let vmas_of_odd_size = || {
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter_map(|l| {
                let (a, b) = l.split_whitespace().next()?.split_once('-')?;
                let len = u64::from_str_radix(b, 16).ok()? - u64::from_str_radix(a, 16).ok()?;
                (len == ODD_SIZE).then_some(())
            })
            .count()
    };
    let specs = [
        RegionSpec::new(GuestAddress(0), ODD_SIZE),
        // Fails in its own mapping step (the file is opened after region 1 is mapped).
        RegionSpec::new(GuestAddress(0x100_0000), 4 * MIB).with_backing(Backing::File {
            path: "/nonexistent/guestmem-missing-backing".into(),
            offset: 0,
        }),
    ];
    // The first region maps fine alone (its VMA is visible), then goes with its map.
    let ok = GuestMap::from_specs(&specs[..1]).unwrap();
    assert_eq!(vmas_of_odd_size(), 1);
    drop(ok);
    assert_eq!(vmas_of_odd_size(), 0);
    // With the second failing, the first is unmapped before the error returns.
    let e = GuestMap::from_specs(&specs).unwrap_err();
    assert!(e.to_string().contains("0x1000000"), "{e}");
    assert_eq!(vmas_of_odd_size(), 0, "the first region was left mapped");
}

/// Faults every page of `map` in with guestmem's own populate, on one thread, unpinned.
fn populate(map: &GuestMap) {
    let cfg = guestmem::PopulateConfig {
        threads: 1,
        pin: guestmem::PinStrategy::None,
        ..guestmem::PopulateConfig::default()
    };
    guestmem::populate(&map.view(), &cfg).unwrap();
}

#[test]
fn thp_region_populated_is_fully_huge_with_and_without_guards() {
    let _serial = serial();
    if !thp_available() {
        guestmem_testkit::skip(format_args!(
            "THP is disabled on this kernel (transparent_hugepage/enabled = never)"
        ));
        return;
    }
    for guard in [Guard::On, Guard::Off] {
        let map = GuestMap::from_specs(&[
            RegionSpec::new(GuestAddress(0x4000_0000), 64 * MIB).with_guard(guard)
        ])
        .unwrap();
        let r = map.view().regions()[0].clone();
        populate(&map);
        let u = inspect_region(&r).unwrap();
        assert_eq!(u.huge_span, 64 * MIB);
        assert_eq!(u.resident, 64 * MIB);
        assert_eq!(
            u.huge, u.huge_span,
            "guard {guard:?}: only {} of {} bytes in huge pages",
            u.huge, u.huge_span
        );
    }
}

#[test]
fn thp_region_without_advice_gets_no_huge_pages_in_madvise_mode() {
    let _serial = serial();
    let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap();
    if !mode.contains("[madvise]") {
        guestmem_testkit::skip(format_args!("THP mode is not madvise ({})", mode.trim()));
        return;
    }
    let map = GuestMap::from_specs(&[
        RegionSpec::new(GuestAddress(0x4000_0000), 8 * MIB).with_thp(Thp::Default)
    ])
    .unwrap();
    let r = map.view().regions()[0].clone();
    populate(&map);
    let u = inspect_region(&r).unwrap();
    assert_eq!(u.resident, 8 * MIB);
    assert_eq!(u.huge, 0);
}

#[test]
fn translator_threads_never_see_wrong_region_during_hot_add_remove() {
    let _serial = serial();
    const READERS: usize = 2;
    const REGION: u64 = 64 * 1024;
    const SLOTS: u64 = 16;
    const STRIDE: u64 = 4 * REGION;
    let sentinel = |addr: u64| addr ^ 0x5a5a_5a5a_0000_0000;
    // Regions are mapped and filled with a sentinel at every page before they are published
    // with `insert`, so any region a translator finds must hold its own sentinels.
    let prepared = |slot: u64| {
        let spec = RegionSpec::new(GuestAddress(slot * STRIDE), REGION);
        let r = guestmem::Region::map(&spec).unwrap();
        for off in (0..r.size()).step_by(4096) {
            // SAFETY: `off` < size and 8-byte aligned; the region is not published yet, so
            // this thread is its only user.
            unsafe {
                (r.host_addr().add(off as usize) as *mut u64)
                    .write_volatile(sentinel(r.guest_addr().0 + off))
            };
        }
        Arc::new(r)
    };
    let map = GuestMap::new();
    for slot in 0..SLOTS / 2 {
        map.insert(prepared(slot)).unwrap();
    }
    let stop = AtomicBool::new(false);
    let (hits, misses) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for k in 0..READERS {
            let mut t = map.translator();
            let (stop, hits, misses) = (&stop, &hits, &misses);
            s.spawn(move || {
                let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ k as u64;
                while !stop.load(Ordering::Relaxed) {
                    t.refresh();
                    for _ in 0..64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let slot = x % SLOTS;
                        let off = (x >> 20) % (REGION / 4096) * 4096;
                        let addr = slot * STRIDE + off;
                        let mut b = [0u8; 8];
                        match t.read_in_region(GuestAddress(addr), &mut b) {
                            Ok(()) => {
                                assert_eq!(u64::from_le_bytes(b), sentinel(addr), "{addr:#x}");
                                hits.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(TranslateError::Unmapped { .. }) => {
                                assert!(t.view().find(GuestAddress(addr)).is_none());
                                misses.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
            });
        }
        let deadline = Instant::now() + Duration::from_millis(700);
        let mut i = 0u64;
        while Instant::now() < deadline {
            let slot = i % SLOTS;
            match map.remove(GuestAddress(slot * STRIDE)) {
                Ok(_) => {}
                Err(MapError::NotFound { .. }) => map.insert(prepared(slot)).unwrap(),
                Err(e) => panic!("{e}"),
            }
            i += 1;
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert!(hits.load(Ordering::Relaxed) > 100, "too few hits");
    assert!(misses.load(Ordering::Relaxed) > 100, "too few misses");
}

#[test]
fn translator_errors_name_the_address() {
    let _serial = serial();
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0x10_0000), 0x1000)]).unwrap();
    let t = map.translator();
    let e = t.translate(GuestAddress(0x20_0000), 4).unwrap_err();
    assert_eq!(e, TranslateError::Unmapped { addr: 0x20_0000 });
    assert!(e.to_string().contains("0x200000"));
    // The vm-memory view through the translator agrees.
    assert!(t.find_region(GuestAddress(0x20_0000)).is_none());
    assert_eq!(
        t.find_region(GuestAddress(0x10_0fff))
            .unwrap()
            .guest_addr()
            .0,
        0x10_0000
    );
}

#[test]
fn inspect_process_sees_a_populated_region_as_the_kernel_maps_it() {
    let _serial = serial();
    if !thp_available() {
        guestmem_testkit::skip(format_args!("THP is disabled on this kernel"));
        return;
    }
    let map =
        GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0x8000_0000), 32 * MIB)]).unwrap();
    let r = map.view().regions()[0].clone();
    populate(&map);
    let all = guestmem::inspect::inspect_process(None, 16 * MIB).unwrap();
    let m = all
        .iter()
        .find(|m| m.start == r.host_addr() as u64)
        .expect("the region's mapping is listed");
    assert_eq!(m.size, 32 * MIB);
    assert_eq!(m.offset_2m, 0);
    assert_eq!(m.resident, 32 * MIB);
    assert_eq!(m.huge, m.huge_span);
}
