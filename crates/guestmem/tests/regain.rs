//! Huge pages back after a restore, against the real kernel: a map that ran on transparent
//! huge pages is saved (the manifest records how much), restored into memory with no THP
//! advice (where a restore's 4 KiB fills stay 4 KiB), and smaps shows `AnonHugePages` back
//! at the saved level once the collapse has run; the bytes read back are the saved ones.
//! A collapse the kernel refuses leaves a whole restore on 4 KiB pages. A lazy restore in
//! 2 MiB blocks into memory that takes huge pages moves them in whole (`UFFDIO_MOVE`): huge
//! from the start, no collapse.

use std::path::PathBuf;
use std::time::Instant;

use guestmem::inspect::inspect;
use guestmem::layout::{RegionSpec, Thp};
use guestmem::restore::{self, Prefetch, RegainHuge, RestoreConfig, RestoreMode, REGAIN_SETTLE};
use guestmem::snapshot::{self, Image, SaveConfig};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};
use guestmem_testkit::Scratch;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 64 * MIB;

/// This kernel's release, and its major and minor numbers.
fn kernel() -> (String, u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut v = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (v.next().unwrap_or(0), v.next().unwrap_or(0));
    (release.trim().to_string(), major, minor)
}

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
    let (release, major, minor) = kernel();
    if (major, minor) < (6, 1) {
        return Some(format!("MADV_COLLAPSE needs Linux 6.1, this is {release}"));
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
        prefetch: Prefetch::WorkingSet,
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
        assert!(
            rep.settle_secs >= REGAIN_SETTLE.as_secs_f64(),
            "{mode:?}: the collapse waits out the guest's first burst: {rep:?}"
        );
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
fn a_collapse_stopped_while_it_settles_ends_at_once_and_collapses_nothing() {
    let _g = guestmem_testkit::host_lock();
    guestmem_testkit::skip_unless!(missing().or_else(no_uffd));
    let dir = Scratch::new("regain-stop");
    let (snap, saved) = saved_thp_map(&dir);
    let image = Image::open(&snap).unwrap();
    let r = restore::restore(&image, &plain(), &cfg(RestoreMode::Lazy, RegainHuge::Saved)).unwrap();
    let lazy = r.lazy.unwrap();
    lazy.wait_complete().unwrap();
    let complete = Instant::now();
    // The collapse is queued (just after the wake above) and waits REGAIN_SETTLE: stop it
    // a fifth of the way in, and it must end then, not at the end of its wait.
    std::thread::sleep(REGAIN_SETTLE / 5);
    let regain = r.regain.as_ref().unwrap();
    let stopped_at = complete.elapsed();
    regain.stop();
    let rep = regain.wait();
    assert!(rep.stopped, "{rep:?}");
    if stopped_at < REGAIN_SETTLE / 2 {
        assert_eq!(rep.collapsed, 0, "stopped while it waited: {rep:?}");
        // Short of the whole settle, with room for the stop's wake-up on a busy host and
        // for the time between the restore's completion (settle_secs counts from there)
        // and this thread's seeing it.
        assert!(
            rep.settle_secs < (REGAIN_SETTLE * 19 / 20).as_secs_f64(),
            "the stop woke it: {rep:?}"
        );
        assert!(
            inspect(&r.map.view()).unwrap()[0].huge < saved,
            "stopped, yet huge pages came back"
        );
    } else {
        // This thread was held up past most of the settle: the collapse may have started
        // before the stop, which it then obeys between chunks.
        eprintln!("the stop came {stopped_at:?} after completion: timing not checked");
    }
    lazy.finish().unwrap();
    check_words(&r.map);
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

/// `UFFDIO_MOVE`, for restores that move huge pages in whole: offered by this kernel, which
/// must be 6.16 or later (guestmem moves nothing on earlier ones).
fn no_move() -> Option<String> {
    use linux_raw_sys::general::{uffdio_api, UFFD_API, UFFD_FEATURE_MOVE};
    let (release, major, minor) = kernel();
    if (major, minor) < (6, 16) {
        return Some(format!(
            "guestmem moves pages in only on Linux 6.16 and later, this is {release}"
        ));
    }
    // SAFETY: flags only.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) } as i32;
    if fd < 0 {
        return Some("userfaultfd unavailable (needs root)".into());
    }
    let mut api = uffdio_api {
        api: u64::from(UFFD_API),
        features: 0,
        ioctls: 0,
    };
    // SAFETY: a uffdio_api for UFFDIO_API on our own descriptor, closed right after.
    let r = unsafe { libc::ioctl(fd, linux_raw_sys::ioctl::UFFDIO_API as _, &mut api) };
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(fd) };
    (r != 0 || api.features & u64::from(UFFD_FEATURE_MOVE) == 0)
        .then(|| "this kernel's userfaultfd does not offer UFFDIO_MOVE".into())
}

#[test]
fn a_lazy_restore_of_2m_blocks_moves_huge_pages_in_whole_and_they_stay_huge() {
    let _g = guestmem_testkit::host_lock();
    guestmem_testkit::skip_unless!(missing().or_else(no_uffd).or_else(no_move));
    let dir = Scratch::new("regain-move");
    // Saved in 2 MiB blocks: each one a whole huge page at a 2 MiB-aligned address.
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), SIZE)]).unwrap();
    let view = map.view();
    for p in 0..SIZE / 4096 {
        view.write_obj(word(p * 4096), GuestAddress(p * 4096))
            .unwrap();
    }
    let snap = dir.join("snap");
    let save = SaveConfig {
        block_bytes: 2 * MIB,
        ..SaveConfig::default()
    };
    let source_huge = inspect(&view).unwrap()[0].huge;
    assert!(
        source_huge >= SIZE / 2,
        "the saved map ran on huge pages (else this host gives none, whatever a restore does): \
         {source_huge:#x}"
    );
    snapshot::save(&view, &snap, &save).unwrap();
    drop(map);
    let image = Image::open(&snap).unwrap();
    // Huge pages asked for (the default spec), no collapse: whatever is huge after came in
    // huge. Faults only, the pages read at once (each fault moves its block), then with
    // prefetch (the prefetch thread moves them).
    let huge = vec![RegionSpec::new(GuestAddress(0), SIZE)];
    for prefetch in [Prefetch::None, Prefetch::WorkingSet] {
        let rcfg = RestoreConfig {
            prefetch,
            ..cfg(RestoreMode::Lazy, RegainHuge::Off)
        };
        let r = restore::restore(&image, &huge, &rcfg).unwrap();
        check_words(&r.map);
        let l = r.lazy.unwrap();
        l.wait_complete().unwrap();
        let rep = l.finish().unwrap();
        assert_eq!(
            (rep.bytes_moved, rep.bytes_copied),
            (SIZE, SIZE),
            "{prefetch:?}: every block moved in: {rep:?}"
        );
        let now = inspect(&r.map.view()).unwrap()[0].huge;
        assert!(
            now >= SIZE / 2,
            "{prefetch:?}: the moved pages are huge: smaps says {now:#x} of {SIZE:#x}"
        );
        check_words(&r.map);
    }
    // Huge pages refused for the target: copied, 4 KiB, as before.
    let no = vec![RegionSpec::new(GuestAddress(0), SIZE).with_thp(Thp::NoHuge)];
    let r = restore::restore(&image, &no, &cfg(RestoreMode::Lazy, RegainHuge::Off)).unwrap();
    let rep = r.lazy.unwrap().finish().unwrap();
    assert_eq!((rep.bytes_moved, rep.bytes_copied), (0, SIZE), "{rep:?}");
    assert_eq!(inspect(&r.map.view()).unwrap()[0].huge, 0);
    check_words(&r.map);
}
