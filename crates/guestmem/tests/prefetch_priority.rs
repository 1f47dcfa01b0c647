//! The priority a lazy restore's prefetch threads run at, as the kernel has it: under
//! `SCHED_IDLE` at nice 5 where this process may bring them back out (`CAP_SYS_NICE`, or an
//! `RLIMIT_NICE` that allows nice 5), else at nice 5 under `SCHED_OTHER`; and the memory
//! they bring in is the saved memory either way.

use std::time::{Duration, Instant};

use guestmem::layout::RegionSpec;
use guestmem::restore::{self, Prefetch, RegainHuge, RestoreConfig, RestoreMode};
use guestmem::snapshot::{self, Image, SaveConfig};
use guestmem::vm_memory::Bytes;
use guestmem::{GuestAddress, GuestMap};
use guestmem_testkit::Scratch;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 256 * MIB;
/// `SCHED_OTHER` and `SCHED_IDLE` as `/proc/<tid>/stat` gives a policy.
const SCHED_OTHER: u32 = 0;
const SCHED_IDLE: u32 = 5;

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

/// Whether this process may take a thread at nice 5 out of `SCHED_IDLE`.
fn may_leave_idle() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let cap = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid, writable rlimit that outlives the call.
    unsafe { libc::getrlimit(libc::RLIMIT_NICE, &mut lim) };
    cap & (1 << 23) != 0 || lim.rlim_cur >= 15
}

/// (policy, nice) of each live thread of this process named `name`.
fn threads_named(name: &str) -> Vec<(u32, i64)> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        // Fields after the name: state is field 3 of the line, nice 19, policy 41.
        let rest: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..]
            .split_whitespace()
            .collect();
        if let (Some(nice), Some(policy)) = (rest.get(16), rest.get(38)) {
            out.push((policy.parse().unwrap(), nice.parse().unwrap()));
        }
    }
    out
}

#[test]
fn prefetch_threads_run_only_on_idle_cpu_time_and_bring_in_every_byte() {
    guestmem_testkit::skip_unless!(no_uffd());
    let dir = Scratch::new("prefetch-idle");
    let map = GuestMap::from_specs(&[RegionSpec::new(GuestAddress(0), SIZE)]).unwrap();
    let view = map.view();
    for p in 0..SIZE / 4096 {
        view.write_obj(word(p), GuestAddress(p * 4096)).unwrap();
    }
    let snap = dir.join("snap");
    snapshot::save(&view, &snap, &SaveConfig::default()).unwrap();
    drop(view);
    drop(map);
    let image = Image::open(&snap).unwrap();
    let cfg = RestoreConfig {
        mode: RestoreMode::Lazy,
        threads: 1,
        handler_threads: 1,
        prefetch: Prefetch::Recorded,
        regain: RegainHuge::Off,
    };
    let r = restore::restore(&image, &[RegionSpec::new(GuestAddress(0), SIZE)], &cfg).unwrap();
    let lazy = r.lazy.unwrap();
    // Nothing faults: the prefetch thread brings in all of it. Look at it meanwhile, until
    // it has lowered itself (it does at its first block) or the restore is complete.
    let t = Instant::now();
    let mut seen = Vec::new();
    while t.elapsed() < Duration::from_secs(20) {
        seen = threads_named("guestmem-prefet");
        let p = lazy.progress();
        if seen.iter().any(|&(_, nice)| nice == 5) || p.done == p.total {
            break;
        }
        std::hint::spin_loop();
    }
    let want = match may_leave_idle() {
        true => SCHED_IDLE,
        false => SCHED_OTHER,
    };
    eprintln!("prefetch threads seen (policy, nice): {seen:?}");
    if !seen.is_empty() {
        assert!(
            seen.iter()
                .all(|&(policy, nice)| (policy, nice) == (want, 5)),
            "prefetch threads (policy, nice): {seen:?}, want ({want}, 5)"
        );
    } else {
        eprintln!("the prefetch ended before it could be looked at: its priority not checked");
    }
    let rep = lazy.finish().unwrap();
    assert_eq!(rep.prefetched_blocks, rep.blocks, "{rep:?}");
    let view = r.map.view();
    for p in 0..SIZE / 4096 {
        let got: u64 = view.read_obj(GuestAddress(p * 4096)).unwrap();
        assert_eq!(got, word(p), "page {p}");
    }
}
