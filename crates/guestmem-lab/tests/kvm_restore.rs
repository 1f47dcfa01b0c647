//! `guestmem-lab vm --save` / `--restore` against real KVM: a restored guest verifies every page
//! it wrote, in every mode; and a lazy restore that meets a bad image mid-run (a flipped
//! byte, a real `EIO` from a FUSE file) stops the guest with the error naming the region,
//! guest address and file offset, within a deadline (no hung vCPU).

mod common;
mod fuse;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use guestmem::restore::{Prefetch, RestoreMode};
use guestmem::snapshot::Image;
use guestmem_lab::vm::perf::{self, PerfConfig, PerfReport, RestoreRun};
use guestmem_lab::vm::VmError;

const MIB: u64 = 1 << 20;

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("kvm-restore")
        .join(name);
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn deadline<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs))
        .unwrap_or_else(|_| panic!("did not finish within {secs} s: a vCPU or handler hung"))
}

fn base() -> PerfConfig {
    PerfConfig {
        memory_bytes: 64 * MIB,
        vcpus: 2,
        slots: 2,
        passes: 1,
        ..PerfConfig::default()
    }
}

/// Runs a guest and saves its memory into `dir/snap`.
fn saved(dir: &Path) -> PathBuf {
    let snap = dir.join("snap");
    let r = perf::run(&PerfConfig {
        save: Some(snap.clone()),
        ..base()
    })
    .unwrap();
    assert!(r.save.is_some());
    snap
}

fn restore_run(dir: &Path, mode: RestoreMode, prefetch: Prefetch, record: bool) -> PerfConfig {
    PerfConfig {
        restore: Some(RestoreRun {
            dir: dir.to_path_buf(),
            mode,
            handler_threads: 2,
            prefetch_threads: 2,
            prefetch,
            record,
            fc_peer: false,
        }),
        ..base()
    }
}

fn run_with_deadline(cfg: PerfConfig) -> Result<PerfReport, VmError> {
    deadline(120, move || perf::run(&cfg))
}

#[test]
fn every_mode_restores_a_guest_that_verifies_clean() {
    if !common::kvm_usable() {
        return;
    }
    let dir = scratch("modes");
    let snap = saved(&dir);
    for (mode, prefetch, record) in [
        (RestoreMode::Eager, Prefetch::None, false),
        (RestoreMode::Mapped, Prefetch::None, false),
        (RestoreMode::Lazy, Prefetch::None, true),
        (RestoreMode::Lazy, Prefetch::WorkingSet, false),
    ] {
        let r = run_with_deadline(restore_run(&snap, mode, prefetch, record))
            .unwrap_or_else(|e| panic!("{mode:?}/{prefetch:?}: {e}"));
        let rr = r.restore.expect("a restore report");
        assert_eq!(rr.mismatches, 0);
        assert_eq!(rr.verify_pages, 64 * MIB / 4096);
        match mode {
            RestoreMode::Eager => assert!(rr.huge_coverage > 0.5, "{rr:?}"),
            RestoreMode::Lazy => {
                let l = rr.lazy.expect("lazy report");
                assert_eq!(l.fault_blocks + l.prefetched_blocks, l.blocks, "{l:?}");
                if prefetch == Prefetch::None {
                    // The guest faulted every block it verified; recorded for the next run.
                    assert!(l.faults >= l.fault_blocks && l.fault_blocks > 30, "{l:?}");
                    assert_eq!(rr.recorded_blocks as u64, l.fault_blocks);
                } else {
                    assert_eq!(
                        l.prefetched_working_set,
                        rr.recorded_blocks.max(l.prefetched_working_set)
                    );
                }
            }
            RestoreMode::Mapped => {}
        }
    }
    assert!(!Image::open(&snap).unwrap().working_set().is_empty());
}

fn expect_stopped(r: Result<PerfReport, VmError>, wants: &[&str]) {
    match r {
        Err(VmError::Restore(msg)) => {
            for w in wants {
                assert!(msg.contains(w), "{msg:?} lacks {w:?}");
            }
        }
        Err(e) => panic!("expected the restore's error, got {e}"),
        Ok(_) => panic!("the guest ran on a bad image"),
    }
}

#[test]
fn flipped_byte_mid_lazy_restore_stops_the_guest() {
    if !common::kvm_usable() {
        return;
    }
    use std::os::unix::fs::FileExt;
    let dir = scratch("flip");
    let snap = saved(&dir);
    let image = Image::open(&snap).unwrap();
    // Second data region: file offset = control (2 MiB) + first slot (32 MiB); 5 MiB in.
    let r = &image.regions()[2];
    let off = r.file_offset + 5 * MIB + 100;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(snap.join("memory"))
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    f.write_all_at(&[b[0] ^ 1], off).unwrap();
    let want_guest = format!("guest {:#x}", r.guest_addr + 5 * MIB);
    let want_off = format!("offset {:#x}", r.file_offset + 5 * MIB);
    for prefetch in [Prefetch::None, Prefetch::WorkingSet] {
        let r = run_with_deadline(restore_run(&snap, RestoreMode::Lazy, prefetch, false));
        expect_stopped(
            r,
            &[
                "checksum",
                &format!("region at {:#x}", image.regions()[2].guest_addr),
                &want_guest,
                &want_off,
            ],
        );
    }
}

#[test]
fn io_error_mid_lazy_restore_stops_the_guest() {
    if !common::kvm_usable() {
        return;
    }
    let dir = scratch("eio");
    let snap = saved(&dir);
    let image = Image::open(&snap).unwrap();
    // The last data region, 20 MiB in: vCPU 1 walks it from its start and meets the error
    // there; vCPU 0 walks the region before, which reads fine.
    let r = &image.regions()[2];
    let fail_from = r.file_offset + 20 * MIB;
    let fail_guest = r.guest_addr + 20 * MIB;
    let real = dir.join("memory.real");
    std::fs::rename(snap.join("memory"), &real).unwrap();
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let fs = match fuse::FailingFile::mount(
        &mnt,
        "memory",
        std::fs::File::open(&real).unwrap(),
        fail_from,
    ) {
        Ok(fs) => fs,
        Err(e) => {
            guestmem_testkit::skip(format_args!(
                "cannot mount a FUSE filesystem here ({e}); needs root and /dev/fuse"
            ));
            return;
        }
    };
    // Snapshot files are never opened through a symlink: the failing file is bind-mounted
    // over a placeholder instead.
    std::fs::write(snap.join("memory"), b"").unwrap();
    let bind = match BindMount::new(&fs.path(), &snap.join("memory")) {
        Ok(b) => b,
        Err(e) => {
            guestmem_testkit::skip(format_args!(
                "cannot bind-mount the FUSE file ({e}); needs root"
            ));
            return;
        }
    };
    let r = run_with_deadline(restore_run(&snap, RestoreMode::Lazy, Prefetch::None, false));
    expect_stopped(
        r,
        &[
            "Input/output error",
            &format!("region at {:#x}", image.regions()[2].guest_addr),
            &format!("guest {fail_guest:#x}"),
            &format!("read at offset {fail_from:#x}"),
        ],
    );
    // Eagerly, the same image fails before the guest starts.
    let r = run_with_deadline(restore_run(
        &snap,
        RestoreMode::Eager,
        Prefetch::None,
        false,
    ));
    match r {
        Err(VmError::Snapshot(e)) => assert!(e.to_string().contains("Input/output error"), "{e}"),
        other => panic!(
            "expected the eager restore's I/O error, got {:?}",
            other.map(|_| ())
        ),
    }
    drop(bind);
    drop(fs);
}

/// A file bind-mounted over another, unmounted on drop.
struct BindMount(std::ffi::CString);

impl BindMount {
    fn new(src: &std::path::Path, dst: &std::path::Path) -> std::io::Result<BindMount> {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &std::path::Path| std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        let (s, d) = (c(src), c(dst));
        // SAFETY: NUL-terminated paths that live across the call; no filesystem type or data.
        let r = unsafe {
            libc::mount(
                s.as_ptr(),
                d.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(BindMount(d))
    }
}

impl Drop for BindMount {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated path; MNT_DETACH never blocks on users.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}
