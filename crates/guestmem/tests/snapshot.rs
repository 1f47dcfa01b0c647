//! Save and restore against the real kernel: round trips for every backing and every mode
//! (bytes read back through the device view), incremental chains, and bad images: each
//! failure named, nothing hung (every wait has a deadline).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use guestmem::host::Host;
use guestmem::layout::{Backing, DirtyTracking, HugePageSize, RegionSpec};
use guestmem::restore::{self, Prefetch, RestoreConfig, RestoreMode};
use guestmem::snapshot::{self, Image, SaveConfig, SaveKind, SnapshotError};
use guestmem::vm_memory::{Address, Bytes};
use guestmem::{GuestAddress, GuestMap};

const MIB: u64 = 1 << 20;
const POOL_2M: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages";
const MODES: [RestoreMode; 3] = [RestoreMode::Eager, RestoreMode::Mapped, RestoreMode::Lazy];

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh directory under the target dir, removed first if a run before left it.
fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("snapshot-tests")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `f` on another thread and fails the test if it takes longer than `secs`.
fn deadline<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("did not finish within {secs} s: hung"))
}

/// Grows the 2 MiB pool by `pages` and puts it back on drop.
struct Pool {
    old: u64,
}

impl Pool {
    fn grow(pages: u64) -> Option<Pool> {
        let old: u64 = std::fs::read_to_string(POOL_2M).ok()?.trim().parse().ok()?;
        if let Err(e) = std::fs::write(POOL_2M, (old + pages).to_string()) {
            eprintln!("skipped: cannot grow the hugetlb pool ({e}); needs root");
            return None;
        }
        let pool = Pool { old };
        match Host::read()
            .pool(HugePageSize::Size2M)
            .map(|p| p.available())
        {
            Some(n) if n >= pages => Some(pool),
            n => {
                eprintln!("skipped: asked for {pages} free 2 MiB pages, the pool has {n:?}");
                None
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = std::fs::write(POOL_2M, self.old.to_string());
    }
}

/// Two regions with a hole between them.
fn specs(backing: Backing) -> Vec<RegionSpec> {
    vec![
        RegionSpec::new(GuestAddress(0), 8 * MIB).with_backing(backing.clone()),
        RegionSpec::new(GuestAddress(64 * MIB), 6 * MIB).with_backing(backing),
    ]
}

fn tracked(specs: Vec<RegionSpec>) -> Vec<RegionSpec> {
    specs
        .into_iter()
        .map(|s| s.with_dirty_tracking(DirtyTracking::On))
        .collect()
}

/// Writes a pattern over some pages of every region (`seed` changes it), zeroes a page it
/// wrote, leaves others untouched.
fn scribble(map: &GuestMap, seed: u8) {
    let snap = map.snapshot();
    for r in snap.regions() {
        let base = r.guest_addr().0;
        let pages = r.size() / 4096;
        for p in (0..pages).filter(|p| p % 3 != 1) {
            let v = seed.wrapping_add((p % 251) as u8) | 1;
            let mut buf = [v; 4096];
            buf[7] = seed;
            snap.write_slice(&buf, GuestAddress(base + p * 4096))
                .unwrap();
        }
        // A page written, then zero again: saved as a hole, read back as zero.
        snap.write_slice(&[0u8; 4096], GuestAddress(base + 3 * 4096))
            .unwrap();
    }
}

fn contents(map: &GuestMap) -> Vec<Vec<u8>> {
    let snap = map.snapshot();
    snap.regions()
        .iter()
        .map(|r| {
            let mut v = vec![0u8; r.size() as usize];
            snap.read_slice(&mut v, r.guest_addr()).unwrap();
            v
        })
        .collect()
}

fn cfg(mode: RestoreMode) -> RestoreConfig {
    RestoreConfig {
        mode,
        threads: 2,
        handler_threads: 2,
        prefetch: Prefetch::None,
    }
}

/// Restores `dir` in `mode` into maps of `specs`, reads everything back (a lazy restore's
/// faults served by its handlers) and compares.
fn check_restore(dir: &Path, specs: &[RegionSpec], mode: RestoreMode, want: &[Vec<u8>]) {
    let image = Image::open(dir).unwrap();
    let specs = specs.to_vec();
    let want = want.to_vec();
    deadline(60, move || {
        let r = restore::restore(&image, &specs, &cfg(mode)).unwrap();
        let got = contents(&r.map);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                let at = g.iter().zip(w).position(|(a, b)| a != b).unwrap();
                panic!("{mode:?}: region {i} differs at offset {at:#x}");
            }
        }
        if let Some(l) = r.lazy {
            let rep = l.finish().unwrap();
            assert!(
                rep.faults > 0,
                "{mode:?}: the reads faulted nothing: {rep:?}"
            );
        }
    });
}

fn round_trip(backing: Backing, name: &str) {
    let specs = specs(backing);
    let map = GuestMap::from_specs(&specs).unwrap();
    scribble(&map, 0x40);
    let want = contents(&map);
    let dir = scratch(name);
    let rep = snapshot::save(&map.snapshot(), &dir, &SaveConfig::default()).unwrap();
    // Sparse: a third of the pages were never written, one more is zero again.
    assert!(rep.bytes_written < rep.memory_bytes * 3 / 4, "{rep:?}");
    let blocks_on_disk = std::fs::metadata(dir.join("memory")).unwrap();
    assert_eq!(blocks_on_disk.len(), 14 * MIB);
    drop(map);
    for mode in MODES {
        check_restore(&dir, &specs, mode, &want);
    }
}

#[test]
fn anonymous_round_trip_every_mode() {
    round_trip(Backing::Anonymous, "anon");
}

#[test]
fn memfd_round_trip_every_mode() {
    round_trip(Backing::Memfd, "memfd");
}

#[test]
fn hugetlb_round_trip_every_mode() {
    let _s = serial();
    let Some(_pool) = Pool::grow(14) else { return };
    round_trip(Backing::Hugetlb(HugePageSize::Size2M), "hugetlb");
    assert_eq!(
        Host::read().pool(HugePageSize::Size2M).unwrap().reserved,
        0,
        "a restore left hugetlb pages reserved"
    );
}

#[test]
fn incremental_chain_of_three_restores_the_last_state() {
    let specs = tracked(specs(Backing::Anonymous));
    let map = GuestMap::from_specs(&specs).unwrap();
    let root = scratch("chain");
    scribble(&map, 1);
    snapshot::save(&map.snapshot(), &root.join("s0"), &SaveConfig::default()).unwrap();
    let snap = map.snapshot();
    // Save 1: a few pages of region 0. Save 2: a page of each, one rewritten to zero.
    snap.write_slice(&[0xAB; 8192], GuestAddress(5 * 4096))
        .unwrap();
    let inc = |parent: &str| SaveConfig {
        kind: SaveKind::Incremental {
            parent: root.join(parent),
        },
        ..SaveConfig::default()
    };
    let r1 = snapshot::save(&snap, &root.join("s1"), &inc("s0")).unwrap();
    assert_eq!(r1.blocks, 1, "{r1:?}");
    snap.write_slice(&[0xCD; 100], GuestAddress(64 * MIB + 4096 * 700))
        .unwrap();
    snap.write_slice(&[0u8; 4096], GuestAddress(6 * 4096))
        .unwrap();
    let r2 = snapshot::save(&snap, &root.join("s2"), &inc("s1")).unwrap();
    assert_eq!(r2.blocks, 2, "{r2:?}");
    let want = contents(&map);
    drop(map);
    assert_eq!(Image::open(&root.join("s2")).unwrap().chain_len(), 3);
    let plain = specs_plain();
    for mode in MODES {
        check_restore(&root.join("s2"), &plain, mode, &want);
    }
    // The middle save restores the middle state: page 6 still 0xAB.
    let image = Image::open(&root.join("s1")).unwrap();
    let r = restore::restore(&image, &plain, &cfg(RestoreMode::Eager)).unwrap();
    let mut b = [0u8; 1];
    r.map
        .snapshot()
        .read_slice(&mut b, GuestAddress(6 * 4096))
        .unwrap();
    assert_eq!(b[0], 0xAB);
}

fn specs_plain() -> Vec<RegionSpec> {
    specs(Backing::Anonymous)
}

/// Saves a scribbled anonymous map into `name`.
fn saved(name: &str) -> PathBuf {
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    scribble(&map, 9);
    let dir = scratch(name);
    snapshot::save(&map.snapshot(), &dir, &SaveConfig::default()).unwrap();
    dir
}

/// Flips one byte of the memory file at `offset`.
fn flip(dir: &Path, offset: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join("memory"))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], offset).unwrap();
}

#[test]
fn flipped_byte_is_named_eagerly_and_lazily() {
    let dir = saved("flip");
    // Region 1 starts at file offset 8 MiB; guest 64 MiB. Offset 1 MiB + 5 in it.
    flip(&dir, 8 * MIB + MIB + 5);
    let image = Image::open(&dir).unwrap();
    let e = restore::restore(&image, &specs_plain(), &cfg(RestoreMode::Eager)).unwrap_err();
    match &e {
        SnapshotError::Checksum {
            region,
            guest_addr,
            offset,
            ..
        } => {
            assert_eq!(
                (*region, *guest_addr, *offset),
                (64 * MIB, 65 * MIB, 9 * MIB),
                "{e}"
            );
        }
        other => panic!("expected a checksum error, got {other}"),
    }
    // Lazy: the prefetch meets the block; nothing touches it; finish names it.
    let image2 = image.clone();
    let msg = deadline(30, move || {
        let mut c = cfg(RestoreMode::Lazy);
        c.prefetch = Prefetch::Recorded;
        let r = restore::restore(&image2, &specs_plain(), &c).unwrap();
        let lazy = r.lazy.unwrap();
        let (tx, rx) = mpsc::channel();
        lazy.on_failure(move |m| {
            let _ = tx.send(m.to_string());
        });
        let hook = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the failure hook ran");
        let e = lazy.finish().unwrap_err();
        assert_eq!(e.to_string(), hook);
        hook
    });
    assert!(
        msg.contains("guest 0x4100000") && msg.contains("offset 0x900000"),
        "{msg}"
    );
}

#[test]
fn truncated_missing_and_garbled_images_are_refused_before_mapping() {
    let dir = saved("truncated");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("memory"))
        .unwrap();
    f.set_len(10 * MIB).unwrap();
    let e = Image::open(&dir).unwrap_err();
    assert!(
        matches!(e, SnapshotError::Truncated { region, .. } if region == 64 * MIB),
        "{e}"
    );
    assert!(e.to_string().contains("0xa00000 bytes (truncated)"), "{e}");

    let dir = saved("missing");
    std::fs::remove_file(dir.join("memory")).unwrap();
    let e = Image::open(&dir).unwrap_err();
    assert!(e.to_string().contains("memory"), "{e}");

    let dir = saved("garbled");
    std::fs::write(dir.join("manifest.json"), b"{\"format\": 3").unwrap();
    let e = Image::open(&dir).unwrap_err();
    assert!(matches!(e, SnapshotError::Manifest { .. }), "{e}");

    let e = Image::open(&scratch("empty")).unwrap_err();
    assert!(e.to_string().contains("manifest.json"), "{e}");
}

#[test]
fn foreign_layout_and_populated_maps_are_refused() {
    let dir = saved("foreign");
    let image = Image::open(&dir).unwrap();
    let other = vec![RegionSpec::new(GuestAddress(0), 16 * MIB)];
    for mode in MODES {
        let e = restore::restore(&image, &other, &cfg(mode)).unwrap_err();
        assert!(
            e.to_string().contains(
                "region 0: the image has 0x800000 bytes at 0x0, the specs 0x1000000 bytes at 0x0"
            ),
            "{e}"
        );
    }
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    map.snapshot()
        .write_slice(&[1u8], GuestAddress(64 * MIB + 4096))
        .unwrap();
    for mode in [RestoreMode::Eager, RestoreMode::Lazy] {
        let e = restore::restore_into(&image, &map, &cfg(mode)).unwrap_err();
        assert!(
            matches!(e, SnapshotError::Populated { region } if region == 64 * MIB),
            "{e}"
        );
    }
    // The refused lazy restore registered nothing: the map still faults normally.
    let mut b = [0u8; 1];
    map.snapshot().read_slice(&mut b, GuestAddress(0)).unwrap();
    // Saving over a snapshot is refused.
    let e = snapshot::save(&map.snapshot(), &dir, &SaveConfig::default()).unwrap_err();
    assert!(matches!(e, SnapshotError::Exists { .. }), "{e}");
}

#[test]
fn lazy_restore_serves_concurrent_readers_and_records_their_order() {
    let dir = saved("concurrent");
    let image = Image::open(&dir).unwrap();
    let want = {
        let r = restore::restore(&image, &specs_plain(), &cfg(RestoreMode::Eager)).unwrap();
        contents(&r.map)
    };
    let image2 = image.clone();
    let ws = deadline(60, move || {
        let r = restore::restore(&image2, &specs_plain(), &cfg(RestoreMode::Lazy)).unwrap();
        let map = std::sync::Arc::new(r.map);
        let readers: Vec<_> = (0..4)
            .map(|t| {
                let map = map.clone();
                std::thread::spawn(move || {
                    let snap = map.snapshot();
                    let mut out = Vec::new();
                    for reg in snap.regions() {
                        let mut v = vec![0u8; reg.size() as usize];
                        // Each reader walks from a different place.
                        let half = (reg.size() / 2) as usize;
                        let (a, b) = v.split_at_mut(half);
                        let (first, second) = if t % 2 == 0 { (a, b) } else { (b, a) };
                        let (o1, o2) = if t % 2 == 0 { (0, half) } else { (half, 0) };
                        snap.read_slice(first, reg.guest_addr().unchecked_add(o1 as u64))
                            .unwrap();
                        snap.read_slice(second, reg.guest_addr().unchecked_add(o2 as u64))
                            .unwrap();
                        out.push(v);
                    }
                    out
                })
            })
            .collect();
        for h in readers {
            assert_eq!(h.join().unwrap(), want);
        }
        let lazy = r.lazy.unwrap();
        let ws = lazy.working_set();
        let rep = lazy.finish().unwrap();
        assert_eq!(
            rep.fault_blocks + rep.prefetched_blocks,
            rep.blocks,
            "{rep:?}"
        );
        assert_eq!(rep.fault_blocks as usize, ws.len());
        ws
    });
    // Every block was read, so every block was faulted, each recorded once.
    let mut sorted = ws.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), ws.len());
    assert_eq!(ws.len() as u64, image.total_blocks());
    image.record_working_set(&ws).unwrap();
    assert_eq!(Image::open(&dir).unwrap().working_set(), ws.as_slice());
}

#[test]
fn a_page_dropped_after_a_lazy_restore_reads_as_zero_not_a_hang() {
    let dir = saved("dontneed");
    let image = Image::open(&dir).unwrap();
    deadline(30, move || {
        let mut c = cfg(RestoreMode::Lazy);
        c.prefetch = Prefetch::Recorded;
        let r = restore::restore(&image, &specs_plain(), &c).unwrap();
        let lazy = r.lazy.unwrap();
        lazy.wait_complete().unwrap();
        let snap = r.map.snapshot();
        let region = &snap.regions()[0];
        let mut b = [0u8; 1];
        snap.read_slice(&mut b, GuestAddress(0)).unwrap();
        assert_ne!(b[0], 0);
        // What a balloon does: the page goes back to the host while still registered.
        // SAFETY: the region's first page, mapped while `snap` lives; its contents may go.
        let ret = unsafe {
            libc::madvise(
                region.host_addr() as *mut libc::c_void,
                4096,
                libc::MADV_DONTNEED,
            )
        };
        assert_eq!(ret, 0);
        snap.read_slice(&mut b, GuestAddress(0)).unwrap();
        assert_eq!(b[0], 0);
        let rep = lazy.finish().unwrap();
        assert!(rep.faults_late >= 1, "{rep:?}");
    });
}

#[test]
fn incremental_saves_check_their_parent_and_short_last_blocks_reopen() {
    // A region whose last block is short (6 MiB + 256 KiB in 1 MiB blocks).
    let specs = tracked(vec![
        RegionSpec::new(GuestAddress(0), 8 * MIB),
        RegionSpec::new(GuestAddress(64 * MIB), 6 * MIB + 256 * 1024),
    ]);
    let map = GuestMap::from_specs(&specs).unwrap();
    scribble(&map, 3);
    let root = scratch("parent-check");
    snapshot::save(&map.snapshot(), &root.join("a"), &SaveConfig::default()).unwrap();
    let snap = map.snapshot();
    // One page of the short last block.
    snap.write_slice(&[7u8; 4096], GuestAddress(64 * MIB + 6 * MIB + 4096))
        .unwrap();
    let inc = |parent: &str| SaveConfig {
        kind: SaveKind::Incremental {
            parent: root.join(parent),
        },
        ..SaveConfig::default()
    };
    snapshot::save(&snap, &root.join("b"), &inc("a")).unwrap();
    let want = contents(&map);
    // A second incremental save on `a` would miss b's pages: refused.
    snap.write_slice(&[9u8; 1], GuestAddress(0)).unwrap();
    let e = snapshot::save(&snap, &root.join("c"), &inc("a")).unwrap_err();
    assert!(e.to_string().contains("count from save"), "{e}");
    drop(map);
    let plain: Vec<RegionSpec> = specs
        .iter()
        .map(|s| s.clone().with_dirty_tracking(DirtyTracking::Off))
        .collect();
    check_restore(&root.join("b"), &plain, RestoreMode::Eager, &want);
    check_restore(&root.join("b"), &plain, RestoreMode::Lazy, &want);
}

#[test]
fn saving_during_a_lazy_restore_is_refused() {
    let dir = saved("save-during-lazy");
    let image = Image::open(&dir).unwrap();
    deadline(30, move || {
        let r = restore::restore(&image, &specs_plain(), &cfg(RestoreMode::Lazy)).unwrap();
        let e = snapshot::save(
            &r.map.snapshot(),
            &scratch("save-during-lazy-out"),
            &SaveConfig::default(),
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("a restore is still filling it"),
            "{e}"
        );
        r.lazy.unwrap().finish().unwrap();
        // Once finished the memory is whole, and a save of it works.
        snapshot::save(
            &r.map.snapshot(),
            &scratch("save-after-lazy"),
            &SaveConfig::default(),
        )
        .unwrap();
    });
}
