//! Populate and pin against the real kernel: every backing, every method, every pin strategy,
//! and a real mid-job failure (a hugetlb pool run dry) that must leave nothing behind.
//!
//! These tests read process-wide figures (VmRSS, VmLck, HugetlbPages) and change the
//! machine-wide hugetlb pool, so they run one at a time ([`serial`]), and every pool change is
//! undone by a guard, on every path.

use std::sync::{Mutex, MutexGuard};

use guestmem::host::{Host, HostError};
use guestmem::inspect::{inspect, ProcessMemory};
use guestmem::layout::{Backing, HugePageSize, RegionSpec, Reserve};
use guestmem::limits::{self, LimitError};
use guestmem::{
    bringup, populate, BringupConfig, GuestAddress, GuestMap, Method, PinStrategy, PopulateConfig,
    PopulateError, Verify,
};

const MIB: u64 = 1 << 20;
const POOL_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";

fn serial() -> MutexGuard<'static, ()> {
    guestmem_testkit::host_lock()
}

/// Free, unreserved pages in a hugetlb pool, or `None` if the pool does not exist.
fn hugetlb_available(size: HugePageSize) -> Option<u64> {
    Host::read().pool(size).map(|p| p.available())
}

/// Sets the 2 MiB pool so exactly `pages` pages are free, and puts it back on drop.
struct PoolGuard {
    old: u64,
}

impl PoolGuard {
    /// `None` (with the reason printed) when the pool cannot be set up: not root, pages in
    /// use by others, or the kernel could not allocate them.
    fn with_available(pages: u64) -> Option<PoolGuard> {
        let old: u64 = std::fs::read_to_string(POOL_2M).ok()?.trim().parse().ok()?;
        let avail = hugetlb_available(HugePageSize::Size2M)?;
        if avail > pages {
            guestmem_testkit::skip(format_args!(
                "the 2 MiB pool already has {avail} free pages (> {pages})"
            ));
            return None;
        }
        if let Err(e) = std::fs::write(POOL_2M, (old + pages - avail).to_string()) {
            guestmem_testkit::skip(format_args!(
                "cannot grow the hugetlb pool ({e}); needs root"
            ));
            return None;
        }
        let guard = PoolGuard { old };
        match hugetlb_available(HugePageSize::Size2M) {
            Some(n) if n == pages => Some(guard),
            n => {
                guestmem_testkit::skip(format_args!(
                    "asked for {pages} free 2 MiB pages, pool has {n:?}"
                ));
                None
            }
        }
    }
}

impl Drop for PoolGuard {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(POOL_2M, self.old.to_string()) {
            eprintln!("could not restore nr_hugepages to {}: {e}", self.old);
        }
    }
}

fn cfg(method: Method, pin: PinStrategy) -> PopulateConfig {
    PopulateConfig {
        threads: 2,
        min_chunk: 2 * MIB,
        method,
        pin,
        ..PopulateConfig::default()
    }
}

fn spec(addr: u64, size: u64) -> RegionSpec {
    RegionSpec::new(GuestAddress(addr), size)
}

/// Writes `byte` at `offset` of the map's region `i`.
fn poke(map: &GuestMap, i: usize, offset: u64, byte: u8) {
    let snap = map.view();
    let r = &snap.regions()[i];
    assert!(offset < r.size());
    // SAFETY: the region maps `size` writable bytes at host_addr, `offset` is inside, and no
    // other thread uses the region during the test.
    unsafe { r.host_addr().add(offset as usize).write_volatile(byte) };
}

fn peek(map: &GuestMap, i: usize, offset: u64) -> u8 {
    let snap = map.view();
    let r = &snap.regions()[i];
    assert!(offset < r.size());
    // SAFETY: as in `poke`.
    unsafe { r.host_addr().add(offset as usize).read_volatile() }
}

#[test]
fn populate_anon_thp_64m_each_method_is_fully_huge() {
    let _s = serial();
    for method in [Method::PopulateWrite, Method::Touch] {
        let map = GuestMap::from_specs(&[spec(0x1_0000_0000, 64 * MIB)]).unwrap();
        poke(&map, 0, 5 * MIB + 123, 0xa5);
        let report = populate(&map.view(), &cfg(method, PinStrategy::None)).unwrap();
        let u = &inspect(&map.view()).unwrap()[0];
        assert_eq!(u.resident, 64 * MIB, "{method:?}");
        assert_eq!(u.huge_span, 64 * MIB);
        assert_eq!(u.huge_coverage(), 1.0, "{method:?}: {u:?}");
        assert_eq!(peek(&map, 0, 5 * MIB + 123), 0xa5, "{method:?} kept data");
        assert_eq!((report.job.threads, report.bytes), (2, 64 * MIB));
    }
}

#[test]
fn populate_memfd_each_method_is_resident_and_keeps_data() {
    let _s = serial();
    for method in [Method::PopulateWrite, Method::Touch] {
        let map = GuestMap::from_specs(&[spec(0, 32 * MIB).with_backing(Backing::Memfd)]).unwrap();
        poke(&map, 0, 7 * MIB, 0x5a);
        populate(&map.view(), &cfg(method, PinStrategy::None)).unwrap();
        let u = &inspect(&map.view()).unwrap()[0];
        assert_eq!(u.resident, 32 * MIB, "{method:?}");
        assert_eq!(peek(&map, 0, 7 * MIB), 0x5a, "{method:?}");
    }
}

#[test]
fn populate_hugetlb_2m_each_method_takes_its_pages() {
    let _s = serial();
    for method in [Method::PopulateWrite, Method::Touch] {
        let Some(_pool) = PoolGuard::with_available(8) else {
            return;
        };
        let huge = spec(0, 16 * MIB).with_backing(Backing::Hugetlb(HugePageSize::Size2M));
        // SAFETY: nothing touches the region before populate, which turns a dry pool into an
        // error; the test reads it back only after populate succeeded.
        let huge = unsafe { huge.with_reserve(Reserve::NoReserve) };
        let map = GuestMap::from_specs(&[huge]).unwrap();
        let before = ProcessMemory::read().unwrap();
        populate(&map.view(), &cfg(method, PinStrategy::UpFront)).unwrap();
        let after = ProcessMemory::read().unwrap();
        let u = &inspect(&map.view()).unwrap()[0];
        assert_eq!((u.resident, u.huge), (16 * MIB, 16 * MIB), "{method:?}");
        assert_eq!(after.hugetlb - before.hugetlb, 16 * MIB);
        assert_eq!(hugetlb_available(HugePageSize::Size2M), Some(0));
        // Hugetlb is never locked: the kernel ignores mlock on it.
        assert_eq!(after.locked, before.locked);
        drop(map);
    }
}

#[test]
fn pin_each_strategy_locks_exactly_the_region_bytes() {
    let _s = serial();
    for pin in [PinStrategy::UpFront, PinStrategy::PerChunk] {
        for method in [Method::PopulateWrite, Method::Touch] {
            let before = ProcessMemory::read().unwrap();
            let map = GuestMap::from_specs(&[
                spec(0, 64 * MIB),
                spec(0x4000_0000, 32 * MIB).with_backing(Backing::Memfd),
            ])
            .unwrap();
            populate(&map.view(), &cfg(method, pin)).unwrap();
            let after = ProcessMemory::read().unwrap();
            assert_eq!(after.locked - before.locked, 96 * MIB, "{pin:?} {method:?}");
            for u in inspect(&map.view()).unwrap() {
                assert_eq!(
                    (u.resident, u.locked),
                    (u.size, u.size),
                    "{pin:?} {method:?}"
                );
            }
            drop(map);
            assert_eq!(ProcessMemory::read().unwrap().locked, before.locked);
        }
    }
}

#[test]
fn populate_hugetlb_pool_dry_fails_and_undoes_everything() {
    let _s = serial();
    for pin in [PinStrategy::UpFront, PinStrategy::PerChunk] {
        for method in [Method::PopulateWrite, Method::Touch] {
            let Some(_pool) = PoolGuard::with_available(4) else {
                return;
            };
            // 32 MiB of anonymous memory that populates fine, and 16 MiB (8 pages) of
            // hugetlb memory that only 4 pages can back: mmap succeeds with MAP_NORESERVE.
            let huge_at = 0x4000_0000;
            let huge = spec(huge_at, 16 * MIB).with_backing(Backing::Hugetlb(HugePageSize::Size2M));
            // SAFETY: the region is touched only by populate (which fails with an error here,
            // never a signal) and read through smaps; no CPU access reaches it.
            let huge = unsafe { huge.with_reserve(Reserve::NoReserve) };
            let map = GuestMap::from_specs(&[spec(0, 32 * MIB), huge]).unwrap();
            let snap = map.view();

            // The check step sees it coming, with the numbers...
            let e = limits::check(&snap, pin).unwrap_err();
            assert!(
                matches!(
                    e,
                    LimitError::Host(HostError::HugetlbPool {
                        needed: 8,
                        available: 4,
                        ..
                    })
                ),
                "{e}"
            );

            // ...and the mechanism, driven past it, fails part-way and undoes its work.
            // The peak of what the job had populated, seen after each chunk it completed.
            let before = ProcessMemory::read().unwrap();
            let peak = std::sync::Arc::new(Mutex::new(ProcessMemory::default()));
            let seen = peak.clone();
            let c = PopulateConfig {
                progress: Some(std::sync::Arc::new(move |_| {
                    let now = ProcessMemory::read().unwrap();
                    let mut p = seen.lock().unwrap();
                    p.hugetlb = p.hugetlb.max(now.hugetlb);
                    p.rss = p.rss.max(now.rss);
                    p.locked = p.locked.max(now.locked);
                })),
                ..cfg(method, pin)
            };
            let e = populate(&snap, &c).unwrap_err();
            let after = ProcessMemory::read().unwrap();
            let want_errno = match method {
                Method::PopulateWrite => libc::EFAULT,
                Method::Touch => libc::EIO,
            };
            match &e {
                PopulateError::Chunk {
                    region,
                    chunk,
                    source,
                    undo_errors,
                    ..
                } => {
                    assert_eq!(*region, huge_at, "{e}");
                    assert!((huge_at..huge_at + 16 * MIB).contains(chunk), "{e}");
                    assert_eq!(source.raw_os_error(), Some(want_errno), "{e}");
                    assert!(undo_errors.is_empty(), "{e}");
                    // The message names the pool, not only the errno.
                    assert!(
                        e.to_string().contains("2 MiB hugetlb pool ran dry")
                            && e.to_string().contains("nr_hugepages"),
                        "{e}"
                    );
                }
                other => panic!("unexpected error {other}"),
            }
            for u in inspect(&snap).unwrap() {
                assert_eq!((u.resident, u.locked), (0, 0), "{pin:?} {method:?}: {u:?}");
            }
            assert_eq!(after.locked, before.locked, "{pin:?} {method:?}");
            assert_eq!(after.hugetlb, before.hugetlb, "{pin:?} {method:?}");
            assert!(
                after.rss.abs_diff(before.rss) < 4 * MIB,
                "{pin:?} {method:?}: rss {} -> {}",
                before.rss,
                after.rss
            );
            assert_eq!(hugetlb_available(HugePageSize::Size2M), Some(4));
            // The job did get part-way before the pool ran dry. (How far is a race: two
            // chunks in flight may split the last pages and both fail.)
            let peak = *peak.lock().unwrap();
            assert!(peak.hugetlb > before.hugetlb, "{pin:?} {method:?}");
            assert!(
                peak.locked > before.locked,
                "{pin:?} {method:?}: nothing was locked"
            );
            eprintln!(
                "{pin:?} {method:?}: {e}\n  peak hugetlb +{} MiB, rss +{} MiB, VmLck +{} MiB; after undo: \
                 rss {:+} KiB, VmLck {} -> {} KiB, HugetlbPages {} -> {} KiB, free pages 4",
                (peak.hugetlb - before.hugetlb) / MIB,
                peak.rss.saturating_sub(before.rss) / MIB,
                (peak.locked - before.locked) / MIB,
                (after.rss as i64 - before.rss as i64) / 1024,
                before.locked / 1024,
                after.locked / 1024,
                before.hugetlb / 1024,
                after.hugetlb / 1024,
            );
            drop(snap);
            drop(map);
        }
    }
}

#[test]
fn bringup_checks_populates_pins_and_reports() {
    let _s = serial();
    let before = ProcessMemory::read().unwrap();
    let map = GuestMap::from_specs(&[spec(0, 64 * MIB), spec(0x1_0000_0000, 16 * MIB)]).unwrap();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let seen = done.clone();
    let cfg = BringupConfig {
        populate: PopulateConfig {
            progress: Some(std::sync::Arc::new(move |b| {
                seen.fetch_max(b, std::sync::atomic::Ordering::Relaxed);
            })),
            ..cfg(Method::PopulateWrite, PinStrategy::UpFront)
        },
        pin_policy: guestmem::PinPolicy::Required,
        verify: Verify::On,
    };
    let r = bringup(&map.view(), &cfg).unwrap();
    assert_eq!((r.regions, r.bytes, r.threads), (2, 80 * MIB, 2));
    assert_eq!(done.load(std::sync::atomic::Ordering::Relaxed), 80 * MIB);
    assert_eq!(r.needs.memlock_bytes, before.locked + 80 * MIB);
    assert!(r
        .usage
        .iter()
        .all(|u| u.resident == u.size && u.locked == u.size));
    assert_eq!(r.process.unwrap().locked - before.locked, 80 * MIB, "{r:?}");
    let names: Vec<_> = r.phases.iter().map(|p| p.name).collect();
    assert_eq!(names, ["check", "lock", "populate", "verify"]);
}

#[test]
fn populate_read_only_region_is_populated_anyway() {
    let _s = serial();
    // The guest may not write it, but the host mapping is writable (images are loaded into
    // it), so it is populated like any other.
    let map =
        GuestMap::from_specs(&[spec(0, 8 * MIB).with_access(guestmem::Access::ReadOnly)]).unwrap();
    for method in [Method::PopulateWrite, Method::Touch] {
        populate(&map.view(), &cfg(method, PinStrategy::None)).unwrap();
        assert_eq!(inspect(&map.view()).unwrap()[0].resident, 8 * MIB);
    }
}

#[test]
fn from_specs_hugetlb_regions_beyond_pool_refused_naming_first_that_does_not_fit() {
    let _s = serial();
    let Some(_pool) = PoolGuard::with_available(4) else {
        return;
    };
    let huge = |addr: u64| {
        RegionSpec::new(GuestAddress(addr), 4 * MIB)
            .with_backing(Backing::Hugetlb(HugePageSize::Size2M))
    };
    let before = ProcessMemory::read().unwrap();
    // Two regions of 2 pages fit a pool of 4 free pages; the third does not.
    let e = GuestMap::from_specs(&[huge(0), huge(0x100_0000), huge(0x200_0000)]).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("0x2000000") && msg.contains("needs 6") && msg.contains("has 4"),
        "{msg}"
    );
    assert_eq!(hugetlb_available(HugePageSize::Size2M), Some(4));
    assert_eq!(ProcessMemory::read().unwrap().hugetlb, before.hugetlb);
    // The two that fit map fine.
    let map = GuestMap::from_specs(&[huge(0), huge(0x100_0000)]).unwrap();
    assert_eq!(map.view().len(), 2);
}

#[test]
fn hugetlb_region_refuses_shrinking_and_stays_usable() {
    let _s = serial();
    let Some(_pool) = PoolGuard::with_available(2) else {
        return;
    };
    let map = GuestMap::from_specs(&[
        spec(0, 4 * MIB).with_backing(Backing::Hugetlb(HugePageSize::Size2M))
    ])
    .unwrap();
    poke(&map, 0, 4 * MIB - 1, 0x5a);
    let snap = map.view();
    let file = snap.regions()[0].file_offset().unwrap().file();
    for len in [0, 2 * MIB, 8 * MIB] {
        let e = file.set_len(len).unwrap_err();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::EPERM),
            "set_len({len:#x}): {e}"
        );
    }
    assert_eq!(peek(&map, 0, 4 * MIB - 1), 0x5a);
    assert_eq!(file.metadata().unwrap().len(), 4 * MIB);
}

#[test]
fn failed_populate_keeps_reserved_hugetlb_pages_and_their_data() {
    let _s = serial();
    let Some(_pool) = PoolGuard::with_available(2) else {
        return;
    };
    // A: reserved, one page, written before the populate. B: two pages without reservation,
    // of which the pool can back only the one A does not hold.
    let b = spec(0x4000_0000, 4 * MIB).with_backing(Backing::Hugetlb(HugePageSize::Size2M));
    // SAFETY: B is touched only by populate (which fails here with an error) and smaps.
    let b = unsafe { b.with_reserve(Reserve::NoReserve) };
    let map = GuestMap::from_specs(&[
        spec(0, 2 * MIB).with_backing(Backing::Hugetlb(HugePageSize::Size2M)),
        b,
    ])
    .unwrap();
    poke(&map, 0, 0x100, 0x77);
    let c = PopulateConfig {
        threads: 1,
        min_chunk: 2 * MIB,
        ..cfg(Method::PopulateWrite, PinStrategy::None)
    };
    assert!(populate(&map.view(), &c).is_err());
    // A's page is still its own: its data reads back, and the pool did not get it back to
    // give to someone else.
    assert_eq!(peek(&map, 0, 0x100), 0x77);
    assert_eq!(hugetlb_available(HugePageSize::Size2M), Some(1));
    let e = GuestMap::from_specs(&[
        spec(0x8000_0000, 4 * MIB).with_backing(Backing::Hugetlb(HugePageSize::Size2M))
    ])
    .unwrap_err();
    assert!(e.to_string().contains("needs 2"), "{e}");
    assert_eq!(peek(&map, 0, 0x100), 0x77);
}

#[test]
fn panicking_progress_leaves_nothing_locked() {
    let _s = serial();
    let map = GuestMap::from_specs(&[spec(0, 16 * MIB)]).unwrap();
    let before = ProcessMemory::read().unwrap().locked;
    for pin in [PinStrategy::UpFront, PinStrategy::PerChunk] {
        let c = PopulateConfig {
            progress: Some(std::sync::Arc::new(|_| panic!("progress callback fails"))),
            ..cfg(Method::PopulateWrite, pin)
        };
        let snap = map.view();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| populate(&snap, &c)));
        assert!(r.is_err(), "{pin:?}: the panic reaches the caller");
        assert_eq!(ProcessMemory::read().unwrap().locked, before, "{pin:?}");
    }
}

#[test]
fn populate_selected_regions_under_running_translators_never_discards_data() {
    use guestmem::{Selection, Undo};
    use std::sync::atomic::{AtomicBool, AtomicU64};
    let _s = serial();
    // Region A is up, pinned, and in use by two device threads that write and verify it.
    let map = GuestMap::from_specs(&[spec(0, 16 * MIB)]).unwrap();
    populate(
        &map.view(),
        &cfg(Method::PopulateWrite, PinStrategy::UpFront),
    )
    .unwrap();
    let locked_before = ProcessMemory::read().unwrap().locked;
    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    std::thread::scope(|s| {
        for k in 0..2u8 {
            let (map, stop, rounds) = (&map, &stop, &rounds);
            s.spawn(move || {
                let t = map.translator();
                let mut n = 0u8;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    n = n.wrapping_add(1);
                    for page in (0..16 * MIB).step_by(64 << 10) {
                        let at = GuestAddress(page + u64::from(k) * 4096);
                        t.write_in_region(at, &[n; 64]).unwrap();
                        let mut b = [0u8; 64];
                        t.read_in_region(at, &mut b).unwrap();
                        assert_eq!(b, [n; 64], "device data lost at {at:?}");
                    }
                    rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }

        // Hot-add B, a file region whose file is truncated behind its back: populating it
        // fails. The call also selects A, in use: A must be neither released nor unlocked.
        let b = GuestAddress(1 << 30);
        let path = failing_file_region(&map, b.0);
        let both = PopulateConfig {
            regions: Selection::Starting(vec![GuestAddress(0), b]),
            ..cfg(Method::PopulateWrite, PinStrategy::UpFront)
        };
        let e = populate(&map.view(), &both).unwrap_err();
        assert!(e.to_string().contains("region at 0x40000000"), "{e}");
        let a = &inspect(&map.view()).unwrap()[0];
        assert_eq!((a.resident, a.locked), (16 * MIB, 16 * MIB), "A kept");
        assert_eq!(ProcessMemory::read().unwrap().locked, locked_before);
        map.remove(b).unwrap();
        std::fs::remove_file(&path).unwrap();

        // Hot-add C and populate it alone: A is not touched, C comes up whole.
        let c = GuestAddress(2 << 30);
        map.add(&spec(c.0, 8 * MIB)).unwrap();
        let only_c = PopulateConfig {
            regions: Selection::Starting(vec![c]),
            undo: Undo::Keep,
            ..cfg(Method::PopulateWrite, PinStrategy::None)
        };
        let r = populate(&map.view(), &only_c).unwrap();
        assert_eq!((r.regions, r.bytes), (1, 8 * MIB));
        let u = inspect(&map.view()).unwrap();
        assert_eq!(u[1].resident, 8 * MIB, "C populated");
        assert_eq!(
            (u[0].resident, u[0].locked),
            (16 * MIB, 16 * MIB),
            "A untouched"
        );
        // A selection naming no region's start is refused.
        let bad = PopulateConfig {
            regions: Selection::Starting(vec![GuestAddress(0x1000)]),
            ..cfg(Method::PopulateWrite, PinStrategy::None)
        };
        assert!(matches!(
            populate(&map.view(), &bad),
            Err(PopulateError::NoSuchRegion { addr: 0x1000 })
        ));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    assert!(rounds.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn bringup_specs_reports_the_map_phase_and_refuses_before_mapping() {
    use guestmem::host::{Host, HostError};
    use guestmem::{bringup_specs, BringupError};
    let _s = serial();
    let cfg = BringupConfig {
        populate: cfg(Method::PopulateWrite, PinStrategy::None),
        verify: Verify::On,
        ..BringupConfig::default()
    };
    let (map, r) = bringup_specs(&[spec(0, 16 * MIB), spec(1 << 30, 16 * MIB)], &cfg).unwrap();
    let names: Vec<&str> = r.phases.iter().map(|p| p.name).collect();
    assert_eq!(names, ["map", "check", "lock", "populate", "verify"]);
    assert_eq!(r.usage.iter().map(|u| u.resident).sum::<u64>(), 32 * MIB);
    drop(map);

    // More than the host has: refused by the host check, before anything is mapped.
    let host = Host::read();
    let too_big = host.mem_available.unwrap() + (1 << 30);
    let before = Host::read().map_count;
    let e = bringup_specs(&[spec(0, too_big)], &cfg).unwrap_err();
    assert!(
        matches!(e, BringupError::Host(HostError::Memory { needed, .. }) if needed == too_big),
        "{e}"
    );
    assert!(Host::read().map_count <= before + 2, "nothing was mapped");
}

#[test]
fn background_bringup_reaches_100_percent_and_reports_a_failure_keeping_data() {
    use guestmem::bringup_background;
    let _s = serial();
    let cfg = BringupConfig {
        populate: PopulateConfig {
            first: vec![(GuestAddress(48 * MIB), 4 * MIB)],
            ..cfg(Method::PopulateWrite, PinStrategy::None)
        },
        verify: Verify::On,
        ..BringupConfig::default()
    };
    // Success: the call returns at once; a "guest" writes and reads while it runs.
    let map = GuestMap::from_specs(&[spec(0, 64 * MIB)]).unwrap();
    let handle = bringup_background(&map, &cfg).unwrap();
    let t = map.translator();
    for page in (0..64 * MIB).step_by(1 << 20) {
        t.write_in_region(GuestAddress(page), &page.to_le_bytes())
            .unwrap();
    }
    let r = handle.wait().unwrap();
    assert_eq!(r.bytes, 64 * MIB);
    assert_eq!(r.usage[0].resident, 64 * MIB);
    for page in (0..64 * MIB).step_by(1 << 20) {
        let mut b = [0u8; 8];
        t.read_in_region(GuestAddress(page), &mut b).unwrap();
        assert_eq!(u64::from_le_bytes(b), page, "the guest's write survived");
    }
    let handle = bringup_background(&map, &cfg).unwrap();
    while !handle.is_finished() {
        std::thread::yield_now();
    }
    assert_eq!(
        handle.progress(),
        guestmem::Progress {
            done: 64 * MIB,
            total: 64 * MIB
        }
    );
    handle.wait().unwrap();

    // Failure part-way: a file region truncated behind its back. The handle reports region,
    // address and errno; nothing is discarded (the guest may have written it).
    let path = std::env::temp_dir().join(format!("guestmem-bg-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; (8 * MIB) as usize]).unwrap();
    let map = GuestMap::from_specs(&[
        spec(0, 16 * MIB),
        spec(1 << 30, 8 * MIB).with_backing(Backing::File {
            path: path.clone(),
            offset: 0,
        }),
    ])
    .unwrap();
    let t = map.translator();
    t.write_in_region(GuestAddress(0x1000), b"guest data")
        .unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(2 * MIB)
        .unwrap();
    let e = bringup_background(&map, &cfg).unwrap().wait().unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("region at 0x40000000")
            && msg.contains("os error 14")
            && msg.contains("0x200000"),
        "{msg}"
    );
    let mut b = [0u8; 10];
    t.read_in_region(GuestAddress(0x1000), &mut b).unwrap();
    assert_eq!(&b, b"guest data");
    drop(t);
    drop(map);
    std::fs::remove_file(&path).unwrap();
}

/// A file region truncated behind its back: populating it fails with EFAULT part-way.
fn failing_file_region(map: &GuestMap, at: u64) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("guestmem-fail-{}-{at:x}", std::process::id()));
    std::fs::write(&path, vec![0u8; (4 * MIB) as usize]).unwrap();
    map.add(&spec(at, 4 * MIB).with_backing(Backing::File {
        path: path.clone(),
        offset: 0,
    }))
    .unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(0)
        .unwrap();
    path
}

#[test]
fn failed_populate_keeps_memfd_data_written_through_its_descriptor() {
    use std::os::unix::fs::FileExt;
    let _s = serial();
    // A VMM (or a vhost-user peer) loads an image through the memfd, never through this
    // process's mapping: smaps shows nothing resident, but the data is there.
    let map = GuestMap::from_specs(&[spec(0, 4 * MIB).with_backing(Backing::Memfd)]).unwrap();
    let snap = map.view();
    let file = snap.regions()[0].file_offset().unwrap().file();
    file.write_at(b"kernel image", 0x1000).unwrap();
    let path = failing_file_region(&map, 1 << 30);
    for method in [Method::PopulateWrite, Method::Touch] {
        let c = PopulateConfig {
            threads: 1,
            ..cfg(method, PinStrategy::None)
        };
        assert!(populate(&map.view(), &c).is_err(), "{method:?}");
        let mut b = [0u8; 12];
        file.read_exact_at(&mut b, 0x1000).unwrap();
        assert_eq!(&b, b"kernel image", "{method:?}: data released");
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn background_bringup_refuses_touch_and_checks_only_its_selection() {
    use guestmem::host::Host;
    use guestmem::{bringup_background, Selection};
    let _s = serial();
    // A never-populated region as large as what the host has available, and a small one:
    // bringing up the small one alone fits, whatever the large one would need.
    let avail = Host::read().mem_available.unwrap();
    let big = (avail - (64 * MIB)) & !(2 * MIB - 1);
    let map = GuestMap::from_specs(&[spec(0, big), spec(1 << 40, 16 * MIB)]).unwrap();
    let only_small = BringupConfig {
        populate: PopulateConfig {
            regions: Selection::Starting(vec![GuestAddress(1 << 40), GuestAddress(1 << 40)]),
            ..cfg(Method::PopulateWrite, PinStrategy::None)
        },
        verify: Verify::Off,
        ..BringupConfig::default()
    };
    let r = bringup_background(&map, &only_small)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        (r.regions, r.bytes),
        (1, 16 * MIB),
        "named twice, populated once"
    );
    // The touch fallback writes: it cannot run beside a guest.
    let touch = BringupConfig {
        populate: PopulateConfig {
            method: Method::Touch,
            ..only_small.populate.clone()
        },
        ..only_small.clone()
    };
    let e = bringup_background(&map, &touch).unwrap_err().to_string();
    assert!(
        e.contains("touch fallback cannot run beside a guest"),
        "{e}"
    );
}

#[test]
fn dropping_a_background_handle_never_panics() {
    use guestmem::bringup_background;
    let _s = serial();
    let map = GuestMap::from_specs(&[spec(0, 16 * MIB)]).unwrap();
    let panicking = BringupConfig {
        populate: PopulateConfig {
            progress: Some(std::sync::Arc::new(|_| panic!("progress callback fails"))),
            ..cfg(Method::PopulateWrite, PinStrategy::None)
        },
        verify: Verify::Off,
        ..BringupConfig::default()
    };
    // Dropped: the callback's panic is part of the lost outcome.
    drop(bringup_background(&map, &panicking).unwrap());
    // Dropped while the caller unwinds: no panic in a destructor, no abort.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _h = bringup_background(&map, &panicking).unwrap();
        panic!("the caller fails");
    }));
    assert!(r.is_err());
    // Waited for: the panic reaches the caller.
    let h = bringup_background(&map, &panicking).unwrap();
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h.wait())).is_err());
}
