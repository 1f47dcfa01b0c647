//! Huge pages back after a restore, against the real kernel: a map that ran on transparent
//! huge pages is saved (the manifest records how much), restored into memory with no THP
//! advice (where a restore's 4 KiB fills stay 4 KiB), and smaps shows `AnonHugePages` back
//! at the saved level once the collapse has run; the bytes read back are the saved ones.
//! A collapse the kernel refuses leaves a whole restore on 4 KiB pages.

use std::path::PathBuf;

use guestmem::inspect::inspect;
use guestmem::layout::{RegionSpec, Thp};
use guestmem::restore::{self, Prefetch, RegainHuge, RestoreConfig, RestoreMode};
use guestmem::snapshot::{self, Image, SaveConfig};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};
use guestmem_testkit::Scratch;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

/// Why THP or MADV_COLLAPSE cannot be tried here, if they cannot.
fn missing() -> Option<String> {
    let thp =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    if thp.is_empty() || thp.contains("[never]") {
        return Some(format!(
            "transparent huge pages are off here ({:?})",
            thp.trim()
        ));
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    if (major, minor) < (6, 1) {
        return Some(format!(
            "MADV_COLLAPSE needs Linux 6.1, this is {}",
            release.trim()
        ));
    }
    None
}

/// Userfaultfd, for the lazy restores.
fn no_uffd() -> Option<String> {
    // SAFETY: flags only; the descriptor is closed at once.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        return Some("userfaultfd unavailable (needs root)".into());
    }
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(fd as i32) };
    None
}

fn word(at: u64) -> u64 {
    at.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5A17
}

/// A 64 MiB map on transparent huge pages, a distinct word in every page, saved: the
/// snapshot's folder and the huge bytes the manifest recorded.
fn saved_thp_map(dir: &Scratch) -> (PathBuf, u64) {
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), SIZE)]).unwrap();
    let view = map.view();
    for p in 0..SIZE / 4096 {
        view.write_obj(word(p * 4096), GuestAddress(p * 4096))
            .unwrap();
    }
    let huge = inspect(&view).unwrap()[0].huge;
    assert!(
        huge >= SIZE / 2,
        "the saved map ran on huge pages: {huge:#x}"
    );
    let snap = dir.join("snap");
    snapshot::save(&view, &snap, &SaveConfig::default()).unwrap();
    let recorded = Image::open(&snap).unwrap().regions()[0].huge_bytes;
    assert_eq!(recorded, huge, "the manifest records what smaps said");
    (snap, recorded)
}

/// The restored map read back word by word.
fn check_words(map: &GuestMap) {
    let view = map.view();
    for p in 0..SIZE / 4096 {
        let got: u64 = view.read_obj(GuestAddress(p * 4096)).unwrap();
        assert_eq!(got, word(p * 4096), "page {p}");
    }
}

/// No THP advice: in `madvise` mode a restore's fills stay on 4 KiB pages.
fn plain() -> Vec<RegionSpec> {
    vec![RegionSpec::new(GuestAddress(0), SIZE).with_thp(Thp::Default)]
}

fn cfg(mode: RestoreMode, regain: RegainHuge) -> RestoreConfig {
    RestoreConfig {
        mode,
        threads: 2,
        handler_threads: 1,
        prefetch: Prefetch::Recorded,
        regain,
    }
}

#[test]
fn a_lazy_and_an_eager_restore_get_back_the_huge_pages_the_saved_map_had() {
    let _g = guestmem_testkit::host_lock();
    guestmem_testkit::skip_unless!(missing().or_else(no_uffd));
    let dir = Scratch::new("regain-back");
    let (snap, saved) = saved_thp_map(&dir);
    let image = Image::open(&snap).unwrap();
    for mode in [RestoreMode::Lazy, RestoreMode::Eager] {
        let r = restore::restore(&image, &plain(), &cfg(mode, RegainHuge::Saved)).unwrap();
        if let Some(l) = &r.lazy {
            l.wait_complete().unwrap();
        }
        let rep = r
            .regain
            .as_ref()
            .expect("the saved map had huge pages")
            .wait();
        eprintln!("{mode:?}: {rep:?}");
        assert_eq!(rep.saved_huge_bytes, Some(saved), "{mode:?}: {rep:?}");
        assert!(
            rep.huge_before < saved,
            "{mode:?}: restored on 4 KiB pages: {rep:?}"
        );
        assert!(
            rep.huge_after >= saved,
            "{mode:?}: back at the saved level: {rep:?}"
        );
        assert_eq!((rep.failed, rep.stopped), (0, false), "{mode:?}: {rep:?}");
        let now = inspect(&r.map.view()).unwrap()[0].huge;
        assert!(now >= saved, "{mode:?}: smaps says {now:#x}");
        check_words(&r.map);
        if let Some(l) = r.lazy {
            let lr = l.finish().unwrap();
            assert_eq!(lr.regain.as_ref(), Some(&rep), "the lazy report carries it");
        }
    }
}

#[test]
fn off_leaves_4k_pages_and_a_refused_collapse_leaves_a_whole_restore() {
    let _g = guestmem_testkit::host_lock();
    guestmem_testkit::skip_unless!(missing().or_else(no_uffd));
    let dir = Scratch::new("regain-off");
    let (snap, _) = saved_thp_map(&dir);
    let image = Image::open(&snap).unwrap();
    // Off: no collapse is queued, and the pages stay as the restore made them.
    let r = restore::restore(&image, &plain(), &cfg(RestoreMode::Lazy, RegainHuge::Off)).unwrap();
    assert!(r.regain.is_none());
    let l = r.lazy.unwrap();
    l.finish().unwrap();
    check_words(&r.map);
    assert_eq!(inspect(&r.map.view()).unwrap()[0].huge, 0);
    drop(r.map);
    // MADV_NOHUGEPAGE memory: the kernel refuses every collapse. Counted and named, and
    // the restore is whole.
    let no = vec![RegionSpec::new(GuestAddress(0), SIZE).with_thp(Thp::NoHuge)];
    let r = restore::restore(&image, &no, &cfg(RestoreMode::Lazy, RegainHuge::Saved)).unwrap();
    r.lazy.as_ref().unwrap().wait_complete().unwrap();
    let rep = r.regain.as_ref().unwrap().wait();
    assert!(rep.failed > 0 && rep.collapsed == 0, "{rep:?}");
    let why = rep.first_failure.clone().unwrap();
    assert!(why.contains("MADV_COLLAPSE"), "{why}");
    assert_eq!(rep.huge_after, 0, "{rep:?}");
    r.lazy.unwrap().finish().unwrap();
    check_words(&r.map);
}

#[test]
fn chunks_the_snapshot_holds_no_data_for_are_not_made_real_memory() {
    let _g = guestmem_testkit::host_lock();
    guestmem_testkit::skip_unless!(missing().or_else(no_uffd));
    let dir = Scratch::new("regain-holes");
    // Only the first half is ever written: the second is a hole in the snapshot.
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), SIZE)]).unwrap();
    let view = map.view();
    for p in 0..SIZE / 2 / 4096 {
        view.write_obj(word(p * 4096), GuestAddress(p * 4096))
            .unwrap();
    }
    let snap = dir.join("snap");
    snapshot::save(&view, &snap, &SaveConfig::default()).unwrap();
    drop(map);
    let image = Image::open(&snap).unwrap();
    assert!(
        image.regions()[0].huge_bytes >= SIZE / 4,
        "{:?}",
        image.regions()[0]
    );
    let r = restore::restore(&image, &plain(), &cfg(RestoreMode::Lazy, RegainHuge::Saved)).unwrap();
    // Every block in (the hole's as the shared zero page), then unregistered: from then on
    // the kernel would collapse a chunk of zero pages into 2 MiB of real memory.
    let lazy = r.lazy.unwrap();
    lazy.wait_complete().unwrap();
    lazy.finish().unwrap();
    let rep = r.regain.as_ref().unwrap().wait();
    assert!(
        rep.skipped >= SIZE / 2 / (2 << 20),
        "the hole's chunks are skipped: {rep:?}"
    );
    let u = inspect(&r.map.view()).unwrap().remove(0);
    assert!(
        u.resident <= SIZE / 2 + (2 << 20),
        "the hole became memory: {} bytes resident of {SIZE}",
        u.resident
    );
    assert!(u.huge >= SIZE / 4, "the data half is huge again: {u:?}");
}
