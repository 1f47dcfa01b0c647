//! A guestmem snapshot pushed to object storage (a real S3 server the test starts in this
//! process) and restored straight from its URL through the library, lazily and eagerly:
//! every byte read back through the device view; a second push of an incremental save
//! uploads only the frames that changed.

use std::path::PathBuf;
use std::sync::Arc;

use guestmem::layout::{DirtyTracking, RegionSpec};
use guestmem::restore::{self, Prefetch, RestoreConfig, RestoreMode};
use guestmem::snapshot::{self, SaveConfig, SaveKind};
use guestmem::store::{
    push, Client, FetchPolicy, FrameCache, Frames, PushConfig, PushSource, StoreMemory, StoreUrl,
};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};
use guestmem_testkit::s3::S3Server;
use guestmem_testkit::Scratch;

const MIB: u64 = 1 << 20;

fn client(s3: &S3Server) -> Arc<Client> {
    let env = s3.env();
    let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
    Arc::new(Client::connect_with("snaps", &get).unwrap())
}

fn specs() -> Vec<RegionSpec> {
    vec![
        RegionSpec::new(GuestAddress(0), 8 * MIB).with_dirty_tracking(DirtyTracking::On),
        RegionSpec::new(GuestAddress(64 * MIB), 6 * MIB).with_dirty_tracking(DirtyTracking::On),
    ]
}

/// Writes `seed`'s pattern into every third page of every region.
fn scribble(map: &GuestMap, seed: u8, every: u64) {
    let v = map.view();
    for r in v.regions() {
        for p in (0..r.size() / 4096).filter(|p| p % every == 0) {
            let mut buf = [seed.wrapping_add((p % 251) as u8) | 1; 4096];
            buf[..8].copy_from_slice(&p.to_le_bytes());
            v.write_slice(&buf, GuestAddress(r.guest_addr().0 + p * 4096))
                .unwrap();
        }
    }
}

fn contents(map: &GuestMap) -> Vec<Vec<u8>> {
    let v = map.view();
    v.regions()
        .iter()
        .map(|r| {
            let mut b = vec![0u8; r.size() as usize];
            v.read_slice(&mut b, r.guest_addr()).unwrap();
            b
        })
        .collect()
}

#[test]
fn a_guestmem_snapshot_is_restored_from_its_url_and_a_diff_shares_its_frames() {
    guestmem_testkit::skip_unless!(guestmem_testkit::firecracker::missing_uffd());
    let d = Scratch::new("store-lib");
    let s3 = S3Server::start("lib", &["snaps"]);
    let map = GuestMap::from_specs(&specs()).unwrap();
    scribble(&map, 3, 3);
    let base_dir: PathBuf = d.join("s0");
    snapshot::save(&map.view(), &base_dir, &SaveConfig::default()).unwrap();
    let c = client(&s3);
    let url = StoreUrl::parse("s3://snaps/lib/s0", false).unwrap();
    let full = push(
        &c,
        &PushSource::Guestmem(base_dir.clone()),
        &url,
        &PushConfig::default(),
    )
    .unwrap();
    assert_eq!(full.frames, 56, "{full:?}");
    assert!(
        full.objects_stored > 0 && full.objects_stored <= 56,
        "{full:?}"
    );

    // A few pages of one MiB changed, saved incrementally, pushed as its whole image: only
    // that frame is new.
    {
        let v = map.view();
        v.write_slice(&[0xee; 4096], GuestAddress(64 * MIB + 5 * 4096))
            .unwrap();
    }
    let inc = SaveConfig {
        kind: SaveKind::Incremental {
            parent: base_dir.clone(),
        },
        ..SaveConfig::default()
    };
    snapshot::save(&map.view(), &d.join("s1"), &inc).unwrap();
    let url1 = url.sibling("lib/s1");
    let diff = push(
        &c,
        &PushSource::Guestmem(d.join("s1")),
        &url1,
        &PushConfig::default(),
    )
    .unwrap();
    assert_eq!(diff.objects_stored, 1, "{diff:?}");
    let want = contents(&map);

    let cache = Arc::new(FrameCache::open(&d.join("cache"), 1 << 30).unwrap());
    let frames = Frames::new(Arc::clone(&c), Some(cache), FetchPolicy::default());
    let memory = StoreMemory::open(frames, &url1).unwrap();
    for mode in [RestoreMode::Lazy, RestoreMode::Eager] {
        let image = memory.image(MIB).unwrap();
        assert!(image.is_remote());
        let cfg = RestoreConfig {
            mode,
            threads: 2,
            handler_threads: 2,
            prefetch: Prefetch::None,
            ..RestoreConfig::default()
        };
        let r = restore::restore(&image, &image.specs(), &cfg).unwrap();
        let got = contents(&r.map);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if g != w {
                let at = g.iter().zip(w).position(|(a, b)| a != b).unwrap();
                panic!("{mode:?}: region {i} differs at offset {at:#x}");
            }
        }
        if let Some(l) = r.lazy {
            let rep = l.finish().unwrap();
            assert!(rep.faults > 0, "{rep:?}");
        }
    }
    // A raw memory file's snapshot has no regions of its own to restore into.
    let raw = d.join("raw");
    std::fs::write(&raw, vec![1u8; MIB as usize]).unwrap();
    let rurl = url.sibling("raw");
    push(&c, &PushSource::Raw(raw), &rurl, &PushConfig::default()).unwrap();
    let frames = Frames::new(Arc::clone(&c), None, FetchPolicy::default());
    let e = StoreMemory::open(frames, &rurl)
        .unwrap()
        .image(MIB)
        .unwrap_err();
    assert!(e.to_string().contains("no regions"), "{e}");
}

/// A VM whose memory is a memfd (shared: a vhost-user backend may map it) restored lazily
/// from the store: each block is read into a buffer of the filling thread's own, then
/// copied into the region's file (a remote image's block is read as a `&mut [u8]`, which
/// memory others may reach must not be), and every byte reads back right.
#[test]
fn a_shared_memory_vm_is_restored_lazily_from_the_store() {
    guestmem_testkit::skip_unless!(guestmem_testkit::firecracker::missing_uffd());
    let d = Scratch::new("store-memfd");
    let s3 = S3Server::start("memfd", &["snaps"]);
    let specs =
        vec![RegionSpec::new(GuestAddress(0), 4 * MIB)
            .with_backing(guestmem::layout::Backing::Memfd)];
    let map = GuestMap::from_specs(&specs).unwrap();
    scribble(&map, 9, 2);
    let dir = d.join("s0");
    snapshot::save(&map.view(), &dir, &SaveConfig::default()).unwrap();
    let c = client(&s3);
    let url = StoreUrl::parse("s3://snaps/memfd/s0", false).unwrap();
    push(&c, &PushSource::Guestmem(dir), &url, &PushConfig::default()).unwrap();
    let want = contents(&map);
    let frames = Frames::new(Arc::clone(&c), None, FetchPolicy::default());
    let image = StoreMemory::open(frames, &url).unwrap().image(MIB).unwrap();
    let cfg = RestoreConfig {
        mode: RestoreMode::Lazy,
        threads: 2,
        handler_threads: 2,
        prefetch: Prefetch::None,
        ..RestoreConfig::default()
    };
    let specs = image.specs();
    assert!(
        specs
            .iter()
            .all(|s| matches!(s.backing(), guestmem::layout::Backing::Memfd)),
        "restored as saved: {specs:?}"
    );
    let r = restore::restore(&image, &specs, &cfg).unwrap();
    let got = contents(&r.map);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        if let Some(at) = g.iter().zip(w).position(|(a, b)| a != b) {
            panic!("region {i} differs at offset {at:#x}");
        }
    }
    let rep = r.lazy.expect("lazy").finish().unwrap();
    assert!(rep.faults > 0, "{rep:?}");
}
