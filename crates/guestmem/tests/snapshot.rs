//! Save and restore against the real kernel: round trips for every backing and every mode
//! (bytes read back through the device view), incremental chains, and bad images: each
//! failure named, nothing hung (every wait has a deadline).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::MutexGuard;
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

fn serial() -> MutexGuard<'static, ()> {
    guestmem_testkit::host_lock()
}

/// Where [`scratch`] makes `name`'s directory.
fn scratch_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("snapshot-tests")
        .join(name)
}

/// A fresh directory under the target dir, removed first if a run before left it.
fn scratch(name: &str) -> PathBuf {
    let d = scratch_path(name);
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
            guestmem_testkit::skip(format_args!(
                "cannot grow the hugetlb pool ({e}); needs root"
            ));
            return None;
        }
        let pool = Pool { old };
        match Host::read()
            .pool(HugePageSize::Size2M)
            .map(|p| p.available())
        {
            Some(n) if n >= pages => Some(pool),
            n => {
                guestmem_testkit::skip(format_args!(
                    "asked for {pages} free 2 MiB pages, the pool has {n:?}"
                ));
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
    let snap = map.view();
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
    let snap = map.view();
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
        ..RestoreConfig::default()
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
    let rep = snapshot::save(&map.view(), &dir, &SaveConfig::default()).unwrap();
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
    // Saved in 2 MiB pages: memory of 4 KiB pages is refused, naming both sizes.
    let image = Image::open(&scratch_path("hugetlb")).unwrap();
    for mode in [RestoreMode::Eager, RestoreMode::Lazy] {
        let e = restore::restore(&image, &specs(Backing::Anonymous), &cfg(mode)).unwrap_err();
        assert!(
            matches!(
                e,
                SnapshotError::PageSizeDiffers {
                    saved: 0x200000,
                    map: 0x1000,
                    ..
                }
            ),
            "{mode:?}: {e}"
        );
        assert!(e.to_string().contains("0x200000") && e.to_string().contains("0x1000"));
    }
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
    snapshot::save(&map.view(), &root.join("s0"), &SaveConfig::default()).unwrap();
    let snap = map.view();
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
        .view()
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
    snapshot::save(&map.view(), &dir, &SaveConfig::default()).unwrap();
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
        c.prefetch = Prefetch::WorkingSet;
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
    map.view()
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
    map.view().read_slice(&mut b, GuestAddress(0)).unwrap();
    // Saving over a snapshot is refused.
    let e = snapshot::save(&map.view(), &dir, &SaveConfig::default()).unwrap_err();
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
                    let snap = map.view();
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
        c.prefetch = Prefetch::WorkingSet;
        let r = restore::restore(&image, &specs_plain(), &c).unwrap();
        let lazy = r.lazy.unwrap();
        lazy.wait_complete().unwrap();
        let snap = r.map.view();
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
    snapshot::save(&map.view(), &root.join("a"), &SaveConfig::default()).unwrap();
    let snap = map.view();
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
            &r.map.view(),
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
            &r.map.view(),
            &scratch("save-after-lazy"),
            &SaveConfig::default(),
        )
        .unwrap();
    });
}

// ---- Trust: each finding of the trust issue (17) as a test. ----

/// Finding 1: two incremental saves of one map from one parent, at once: one succeeds, the
/// other is refused naming the parent, and the chain that exists restores the map's memory.
#[test]
fn two_incremental_saves_from_one_parent_give_one_success_and_one_clear_error() {
    let _s = serial();
    let root = scratch("inc-race");
    let specs = tracked(specs_plain());
    for round in 0..5u8 {
        let map = std::sync::Arc::new(GuestMap::from_specs(&specs).unwrap());
        scribble(&map, 1 + round);
        let parent = root.join(format!("p{round}"));
        snapshot::save(&map.view(), &parent, &SaveConfig::default()).unwrap();
        scribble(&map, 100 + round);
        let want = contents(&map);
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let runs: Vec<_> = (0..2)
            .map(|k| {
                let (map, barrier, parent) = (map.clone(), barrier.clone(), parent.clone());
                let dir = root.join(format!("c{round}-{k}"));
                std::thread::spawn(move || {
                    let cfg = SaveConfig {
                        kind: SaveKind::Incremental { parent },
                        ..SaveConfig::default()
                    };
                    barrier.wait();
                    (dir.clone(), snapshot::save(&map.view(), &dir, &cfg))
                })
            })
            .collect();
        let results: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
        let ok: Vec<_> = results.iter().filter(|(_, r)| r.is_ok()).collect();
        assert_eq!(
            ok.len(),
            1,
            "round {round}: exactly one incremental save succeeds"
        );
        let (_, err) = results.iter().find(|(_, r)| r.is_err()).unwrap();
        let e = err.as_ref().unwrap_err().to_string();
        assert!(e.contains("not from the parent"), "round {round}: {e}");
        // The refused save left nothing where it was asked to save.
        let refused = &results.iter().find(|(_, r)| r.is_err()).unwrap().0;
        assert!(!refused.exists(), "round {round}: {}", refused.display());
        check_restore(&ok[0].0, &specs, RestoreMode::Eager, &want);
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Finding 2: two full saves of two maps into one path, at once: one publishes, the other
/// is refused, and the path restores exactly the winner's memory, never a mix.
#[test]
fn two_full_saves_into_one_path_publish_one_whole_snapshot() {
    let _s = serial();
    let root = scratch("full-race");
    let maps: Vec<_> = (0..2u8)
        .map(|k| {
            let m = std::sync::Arc::new(GuestMap::from_specs(&specs_plain()).unwrap());
            scribble(&m, 30 + k * 50);
            m
        })
        .collect();
    let wants: Vec<_> = maps.iter().map(|m| contents(m)).collect();
    for round in 0..5 {
        let target = root.join(format!("snap{round}"));
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let runs: Vec<_> = maps
            .iter()
            .map(|m| {
                let (m, barrier, target) = (m.clone(), barrier.clone(), target.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    snapshot::save(&m.view(), &target, &SaveConfig::default())
                })
            })
            .collect();
        let results: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
        let winner = match (&results[0], &results[1]) {
            (Ok(_), Err(SnapshotError::Exists { .. })) => 0,
            (Err(SnapshotError::Exists { .. }), Ok(_)) => 1,
            other => panic!("round {round}: one save publishes, one is refused: {other:?}"),
        };
        check_restore(&target, &specs_plain(), RestoreMode::Eager, &wants[winner]);
        // Nothing but the snapshot is left: no staging directory, no temporary.
        let left: Vec<_> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "round {round}: left behind {left:?}");
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Finding 3: a save never overwrites a file, never writes through a symlink, and saves
/// into an empty directory.
#[test]
fn a_save_never_overwrites_or_writes_through_a_symlink() {
    let _s = serial();
    let root = scratch("no-overwrite");
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    scribble(&map, 5);
    let victim = root.join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    // A directory holding a memory file.
    let holds = root.join("holds");
    std::fs::create_dir(&holds).unwrap();
    std::fs::write(holds.join("memory"), b"precious").unwrap();
    // A directory whose memory file is a symlink to the victim.
    let links = root.join("links");
    std::fs::create_dir(&links).unwrap();
    std::os::unix::fs::symlink(&victim, links.join("memory")).unwrap();
    // The target itself a symlink to a directory.
    let elsewhere = root.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let dirlink = root.join("dirlink");
    std::os::unix::fs::symlink(&elsewhere, &dirlink).unwrap();
    for target in [&holds, &links, &dirlink, &victim] {
        let e = snapshot::save(&map.view(), target, &SaveConfig::default()).unwrap_err();
        assert!(
            matches!(e, SnapshotError::Exists { .. }),
            "{}: {e}",
            target.display()
        );
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert_eq!(std::fs::read(holds.join("memory")).unwrap(), b"precious");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    // An empty directory is a place to save into.
    let empty = root.join("empty");
    std::fs::create_dir(&empty).unwrap();
    snapshot::save(&map.view(), &empty, &SaveConfig::default()).unwrap();
    assert!(Image::open(&empty).is_ok());
    let _ = std::fs::remove_dir_all(&root);
}

/// Rewrites `dir`'s manifest with `edit` applied to its JSON.
fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("manifest.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

/// Findings 4 and 5: crafted manifests and hostile files are refused by name before any
/// large allocation or any wait: block sizes past the caps, a manifest past its size cap, a
/// symlink to /dev/zero, FIFOs, a directory as the memory file.
#[test]
fn hostile_snapshot_files_are_refused_by_name_without_hanging_or_allocating() {
    let _s = serial();
    let base = saved("hostile-base");
    let copy = |name: &str| {
        let d = scratch(name);
        for f in ["manifest.json", "memory"] {
            std::fs::copy(base.join(f), d.join(f)).unwrap();
        }
        d
    };
    let mkfifo = |p: &Path| {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    };
    const TOO_BIG: &str = "more than the 67108864 allowed";
    assert!(TOO_BIG.contains(&snapshot::MAX_MANIFEST_BYTES.to_string()));
    let mut cases: Vec<(PathBuf, &str)> = Vec::new();
    // 2 GiB blocks: past MAX_PAGE_BLOCK_BYTES (each restoring thread would stage one).
    let d = copy("hostile-2g");
    edit_manifest(&d, |v| v["block_bytes"] = (2u64 << 30).into());
    cases.push((d, "is not a power of two from 4 KiB to 0x40000000"));
    // 1 GiB blocks over 4 KiB pages: past the small-page cap.
    let d = copy("hostile-1g");
    edit_manifest(&d, |v| v["block_bytes"] = (1u64 << 30).into());
    cases.push((d, "at most 0x4000000"));
    // A manifest past its size cap (sparse: nothing is written or read).
    let d = copy("hostile-huge");
    std::fs::OpenOptions::new()
        .write(true)
        .open(d.join("manifest.json"))
        .unwrap()
        .set_len(snapshot::MAX_MANIFEST_BYTES + 1)
        .unwrap();
    cases.push((d, TOO_BIG));
    // A symlink to /dev/zero as the manifest.
    let d = copy("hostile-zero");
    std::fs::remove_file(d.join("manifest.json")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", d.join("manifest.json")).unwrap();
    cases.push((d, "is a symlink"));
    // FIFOs: as the manifest and as the memory file.
    let d = copy("hostile-fifo-manifest");
    std::fs::remove_file(d.join("manifest.json")).unwrap();
    mkfifo(&d.join("manifest.json"));
    cases.push((d, "is a FIFO"));
    let d = copy("hostile-fifo-memory");
    std::fs::remove_file(d.join("memory")).unwrap();
    mkfifo(&d.join("memory"));
    cases.push((d, "is a FIFO"));
    // A directory as the memory file.
    let d = copy("hostile-dir-memory");
    std::fs::remove_file(d.join("memory")).unwrap();
    std::fs::create_dir(d.join("memory")).unwrap();
    cases.push((d, "is a directory"));
    // A memory file name that leaves the directory.
    let d = copy("hostile-escape");
    edit_manifest(&d, |v| v["memory_file"] = "../victim".into());
    cases.push((d, "must be a plain name"));
    for (dir, says) in cases {
        let shown = dir.display().to_string();
        let e = deadline(10, move || {
            Image::open(&dir).map(|_| ()).unwrap_err().to_string()
        });
        assert!(e.contains(says), "{shown}: {e}");
        let _ = std::fs::remove_dir_all(&shown);
    }
}

/// Finding 6: a populate over a map whose lazy restore is still running is refused, and the
/// restored data is intact after it.
#[test]
fn populate_during_a_lazy_restore_is_refused_and_restored_data_stays() {
    let _s = serial();
    let dir = saved("populate-during-lazy");
    let image = Image::open(&dir).unwrap();
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    scribble(&map, 9);
    let want = contents(&map);
    drop(map);
    deadline(30, move || {
        let r = restore::restore(&image, &specs_plain(), &cfg(RestoreMode::Lazy)).unwrap();
        let e =
            guestmem::populate(&r.map.view(), &guestmem::PopulateConfig::default()).unwrap_err();
        assert!(
            e.to_string().contains("a restore is still filling it"),
            "{e}"
        );
        assert_eq!(
            r.map.view().regions()[0].restore_state(),
            restore::RestoreState::Restoring
        );
        assert_eq!(contents(&r.map), want);
        r.lazy.unwrap().finish().unwrap();
        assert_eq!(
            r.map.view().regions()[0].restore_state(),
            restore::RestoreState::Whole
        );
        // Whole again: populating it now keeps the data.
        guestmem::populate(&r.map.view(), &guestmem::PopulateConfig::default()).unwrap();
        assert_eq!(contents(&r.map), want);
    });
}

/// Finding 7: a mapped restore maps the memory file `Image::open` checked, not one renamed
/// over it since.
#[test]
fn a_mapped_restore_maps_the_file_that_was_checked() {
    let _s = serial();
    let dir = saved("mapped-swap");
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    scribble(&map, 9);
    let want = contents(&map);
    let image = Image::open(&dir).unwrap();
    // Swap in a file of the same size holding other bytes.
    let other = dir.join("other");
    std::fs::write(&other, vec![0x5au8; 14 * MIB as usize]).unwrap();
    std::fs::rename(&other, dir.join("memory")).unwrap();
    let r = restore::restore(&image, &specs_plain(), &cfg(RestoreMode::Mapped)).unwrap();
    assert_eq!(contents(&r.map), want);
}

/// Finding 13: a failure hook that reads the failed block does not hang `finish()` (the
/// block is poisoned before the hooks run, on a thread of their own); the poisoned page
/// raises SIGBUS with `BUS_ADRERR` in a process that touches it.
#[test]
fn a_hook_that_reads_the_failed_block_does_not_hang_finish() {
    let _s = serial();
    let dir = saved("hook-reads");
    // Block 2 of the first region (guest 2 MiB): written by scribble, now corrupt.
    flip(&dir, 2 * MIB + 100);
    let image = Image::open(&dir).unwrap();
    deadline(30, move || {
        let cfg = RestoreConfig {
            prefetch: Prefetch::WorkingSet,
            threads: 1,
            handler_threads: 1,
            mode: RestoreMode::Lazy,
            ..RestoreConfig::default()
        };
        let r = restore::restore(&image, &specs_plain(), &cfg).unwrap();
        let host = r.map.view().regions()[0].host_addr() as usize + 2 * MIB as usize;
        let (tx, rx) = mpsc::channel();
        let lazy = r.lazy.unwrap();
        lazy.on_failure(move |_| {
            // Read the failed block through the kernel, as a device model might.
            let mut buf = [0u8; 64];
            let local = libc::iovec {
                iov_base: buf.as_mut_ptr() as *mut libc::c_void,
                iov_len: buf.len(),
            };
            let remote = libc::iovec {
                iov_base: host as *mut libc::c_void,
                iov_len: buf.len(),
            };
            // SAFETY: local is our own buffer; the remote range is read by the kernel from
            // our address space, never dereferenced here.
            let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
            let _ = tx.send(n);
        });
        let n = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the hook ran and its read returned");
        assert_eq!(
            n, -1,
            "the failed block reads as lost memory, not data or zeros"
        );
        let e = lazy.finish().unwrap_err();
        assert!(matches!(e, SnapshotError::Checksum { .. }), "{e}");
        assert_eq!(
            r.map.view().regions()[0].restore_state(),
            restore::RestoreState::Lost
        );
        assert_eq!(sigbus_code_reading(host), Some(libc::BUS_ADRERR));
    });
}

/// Forks a child that reads the byte at `addr`; the `si_code` of the SIGBUS it took, or
/// `None` if it read without one.
fn sigbus_code_reading(addr: usize) -> Option<i32> {
    extern "C" fn on_bus(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; _exit is
        // async-signal-safe.
        unsafe { libc::_exit((*info).si_code) };
    }
    // SAFETY: the child only calls async-signal-safe functions (sigaction, a volatile read,
    // _exit) before it exits; the parent waits for it.
    unsafe {
        let pid = libc::fork();
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_bus as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO;
            libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
            let _ = std::ptr::read_volatile(addr as *const u8);
            libc::_exit(100);
        }
        let mut status = 0;
        libc::waitpid(pid, &mut status, 0);
        let code = libc::WEXITSTATUS(status);
        (code != 100).then_some(code)
    }
}

/// Environment variable that makes this test binary a saver to be killed (see `crash_saver`).
const CRASH_TARGET: &str = "GM_TEST_CRASH_SAVE_TARGET";
/// The scribble seed the saver's memory holds.
const CRASH_SEED: u8 = 77;

/// Not a test of its own: run by `a_save_killed_at_any_point_leaves_no_snapshot_or_a_whole_one`
/// as a child process, which it kills mid-save.
#[test]
fn crash_saver() {
    let Ok(target) = std::env::var(CRASH_TARGET) else {
        return;
    };
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    scribble(&map, CRASH_SEED);
    std::fs::write(format!("{target}.ready"), b"").unwrap();
    let cfg = SaveConfig {
        threads: 2,
        ..SaveConfig::default()
    };
    snapshot::save(&map.view(), Path::new(&target), &cfg).unwrap();
    std::fs::write(format!("{target}.done"), b"").unwrap();
}

/// Deliver 1 (crash consistency): a save killed with SIGKILL at a random point, 50 times in
/// a child process, leaves either no snapshot at its path or one that restores the saved
/// memory whole; never a mix, never a half.
#[test]
fn a_save_killed_at_any_point_leaves_no_snapshot_or_a_whole_one() {
    let _s = serial();
    let root = scratch("crash");
    let want = {
        let map = GuestMap::from_specs(&specs_plain()).unwrap();
        scribble(&map, CRASH_SEED);
        contents(&map)
    };
    let spawn = |target: &Path| {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "crash_saver",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CRASH_TARGET, target)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    use guestmem_testkit::ChildGuard;
    let wait_for = |p: &Path, secs: u64| {
        let t = std::time::Instant::now();
        while !p.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(secs),
                "{} never appeared",
                p.display()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    };
    let marker = |target: &Path, what: &str| PathBuf::from(format!("{}.{what}", target.display()));
    // How long a whole save takes here, from the child's "ready" to its "done".
    let calibrate = root.join("calibrate");
    let mut child = ChildGuard::new(spawn(&calibrate));
    wait_for(&marker(&calibrate, "ready"), 30);
    let t = std::time::Instant::now();
    wait_for(&marker(&calibrate, "done"), 30);
    let save_us = t.elapsed().as_micros().max(1000) as u64;
    assert!(child.wait_exit(60).success());
    let mut rng = 0x9e37_79b9_7f4a_7c15u64 ^ save_us;
    let (mut whole, mut none) = (0, 0);
    for i in 0..50 {
        let target = root.join(format!("snap{i}"));
        let mut child = ChildGuard::new(spawn(&target));
        wait_for(&marker(&target, "ready"), 30);
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        // Anywhere from the start of the save to a little past its usual end.
        std::thread::sleep(Duration::from_micros(rng % (save_us * 3 / 2)));
        let _ = child.child().kill();
        let _ = child.child().wait();
        if target.exists() {
            let image = Image::open(&target)
                .unwrap_or_else(|e| panic!("try {i}: a published snapshot must open: {e}"));
            let r = restore::restore(&image, &specs_plain(), &cfg(RestoreMode::Eager))
                .unwrap_or_else(|e| panic!("try {i}: a published snapshot must restore: {e}"));
            assert!(contents(&r.map) == want, "try {i}: restored memory differs");
            whole += 1;
        } else {
            none += 1;
        }
    }
    eprintln!("50 saves killed: {whole} left a whole snapshot, {none} left none");
    let _ = std::fs::remove_dir_all(&root);
}

/// What a killed save leaves (an unlocked staging directory) is removed by a later save
/// beside it once it is over a minute old; a symlink named like one is never followed.
#[test]
fn dead_saves_are_swept_and_symlinks_named_like_them_are_not_followed() {
    let _s = serial();
    let root = scratch("sweep");
    let dead = root.join(".snap.guestmem-save-dead");
    std::fs::create_dir(&dead).unwrap();
    std::fs::write(dead.join("memory"), b"half a save").unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(120);
    std::fs::File::open(&dead)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let victim = root.join("victim");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("memory"), b"precious").unwrap();
    std::fs::write(victim.join("manifest.json"), b"precious").unwrap();
    std::os::unix::fs::symlink(&victim, root.join(".snap.guestmem-save-link")).unwrap();
    let map = GuestMap::from_specs(&specs_plain()).unwrap();
    scribble(&map, 3);
    snapshot::save(&map.view(), &root.join("snap"), &SaveConfig::default()).unwrap();
    assert!(!dead.exists(), "the dead save's staging directory is swept");
    assert_eq!(std::fs::read(victim.join("memory")).unwrap(), b"precious");
    assert_eq!(
        std::fs::read(victim.join("manifest.json")).unwrap(),
        b"precious"
    );
    assert!(Image::open(&root.join("snap")).is_ok());
    let _ = std::fs::remove_dir_all(&root);
}
