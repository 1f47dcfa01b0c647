//! Where both CPUs went in a timed part: each thread of the lab's process by what it stands
//! for (the VM's reader, the page server, the S3 server, the proxy that stands for the
//! wire), and the whole host's busy, idle and stolen time. On this 2-CPU host the S3
//! server and the proxy take the CPUs a remote store would not: this says how much.
//!
//! A thread's time is its scheduler's run time (`/proc/self/task/TID/schedstat`, in
//! nanoseconds); the host's is `/proc/stat`'s (in ticks of 10 ms, so a part of 0.2 s is
//! known to about 0.01 s a CPU; a running thread's run time is brought up to date at its
//! next tick, so a snapshot may miss up to a tick of each thread that runs as it is taken).
//! A thread that ends inside the window is left out, its time in `rest`: the VM's readers
//! do, and the scenario counts them by their own clocks instead; of the page server's, a
//! VM's handshake thread does (one a VM, short); its fault, prefetch, stage, cache and
//! client threads, the S3 server's and the proxy's outlive the timed part.

use std::collections::HashMap;
use std::time::Instant;

/// What a thread stands for, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Part {
    /// The stand-in VM's readers (`vm-reader`).
    Vm,
    /// The page server: its threads and its store client's (`guestmem-*`, the server's
    /// supervisor).
    Server,
    /// The S3 server (`s3-server*`).
    Store,
    /// The proxy (`s3-proxy*`): the wire between this host and the store.
    Wire,
    /// The lab's own (its main thread, which waits).
    Lab,
}

impl Part {
    fn of(comm: &str) -> Part {
        // Linux keeps 15 bytes of a name: the lab's `guestmem-lab-signals` is
        // `guestmem-lab-si`.
        if comm.starts_with("vm-reader") {
            Part::Vm
        } else if comm.starts_with("guestmem-lab") {
            Part::Lab
        } else if comm.starts_with("guestmem-") {
            Part::Server
        } else if comm.starts_with("s3-server") {
            Part::Store
        } else if comm.starts_with("s3-proxy") {
            Part::Wire
        } else {
            Part::Lab
        }
    }
}

/// The host's CPU times from `/proc/stat`, ticks.
#[derive(Debug, Clone, Copy, Default)]
struct Host {
    busy: u64,
    idle: u64,
    steal: u64,
}

impl Host {
    fn read() -> Host {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
            return Host::default();
        };
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        let at = |i: usize| f.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        Host {
            busy: at(0) + at(1) + at(2) + at(5) + at(6),
            idle: at(3) + at(4),
            steal: at(7),
        }
    }
}

/// Every thread's run time and the host's, at one moment.
pub(super) struct Snapshot {
    at: Instant,
    threads: HashMap<u32, (Part, u64)>,
    host: Host,
}

impl Snapshot {
    /// Now: two small files read a thread of the process (a few ms for the lab's 150-250
    /// threads on a busy host; the scenario takes it on a thread of its own, not the VM's).
    fn take() -> Snapshot {
        let at = Instant::now();
        let mut threads = HashMap::new();
        if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
            for e in dir.flatten() {
                let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
                    continue;
                };
                let p = e.path();
                let ns = std::fs::read_to_string(p.join("schedstat"))
                    .ok()
                    .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
                let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
                if let Some(ns) = ns {
                    threads.insert(tid, (Part::of(comm.trim_end()), ns));
                }
            }
        }
        Snapshot {
            at,
            threads,
            host: Host::read(),
        }
    }

    /// What went where from `self` until `later`.
    pub(super) fn until(&self, later: &Snapshot) -> CpuSplit {
        let mut by: HashMap<Part, u64> = HashMap::new();
        for (tid, (part, ns)) in &later.threads {
            let before = self.threads.get(tid).map_or(0, |t| t.1);
            *by.entry(*part).or_default() += ns.saturating_sub(before);
        }
        let secs = |p: Part| by.get(&p).copied().unwrap_or(0) as f64 / 1e9;
        // SAFETY: sysconf takes a plain name.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let ticks = |a: u64, b: u64| b.saturating_sub(a) as f64 / hz;
        CpuSplit {
            wall_secs: later.at.duration_since(self.at).as_secs_f64(),
            vm: secs(Part::Vm),
            server: secs(Part::Server),
            store: secs(Part::Store),
            wire: secs(Part::Wire),
            lab: secs(Part::Lab),
            host_busy: ticks(self.host.busy, later.host.busy),
            idle: ticks(self.host.idle, later.host.idle),
            steal: ticks(self.host.steal, later.host.steal),
        }
    }
}

/// A round's looks at every thread: at its start, when the VM has read its working set
/// (taken by a thread of the lab's, so that the VM's reader goes on at once: taken in the
/// reader, its pause let read-ahead run on, 415-418 GETs at the working set where 410 was
/// its own), and at its end.
pub(super) struct Windows {
    at_ws: std::sync::mpsc::Sender<()>,
    ws: std::thread::JoinHandle<Option<Snapshot>>,
}

impl Windows {
    /// Its thread started (before the first look: its own time is the lab's).
    pub(super) fn new() -> std::io::Result<Windows> {
        let (at_ws, told) = std::sync::mpsc::channel::<()>();
        let ws = std::thread::Builder::new()
            .name("lab-cpu".into())
            .spawn(move || told.recv().ok().map(|()| Snapshot::take()))?;
        Ok(Windows { at_ws, ws })
    }

    /// The first look, at the round's start.
    pub(super) fn start(&self) -> Snapshot {
        Snapshot::take()
    }

    /// The VM has read its working set: the look is taken now.
    pub(super) fn working_set_read(&self) {
        let _ = self.at_ws.send(());
    }

    /// The last look, at the round's end: what went where until the working set was read
    /// (until the end, where [`Windows::working_set_read`] was not called) and until the
    /// end.
    pub(super) fn end(self, start: &Snapshot) -> (CpuSplit, CpuSplit) {
        let end = Snapshot::take();
        drop(self.at_ws);
        let ws = self.ws.join().ok().flatten();
        (start.until(ws.as_ref().unwrap_or(&end)), start.until(&end))
    }
}

/// CPU seconds by part over one timed window.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CpuSplit {
    /// The window, seconds.
    pub wall_secs: f64,
    /// The stand-in VM's readers (by their own CPU clocks, set by the scenario).
    pub vm: f64,
    /// The page server (its fault, prefetch, stage and cache threads, its store client's).
    pub server: f64,
    /// The S3 server.
    pub store: f64,
    /// The proxy (the wire).
    pub wire: f64,
    /// The rest of the lab's process.
    pub lab: f64,
    /// Every CPU's busy time (`/proc/stat`: user, nice, system, irq, softirq), this process
    /// and all else: the kernel's threads, other processes.
    pub host_busy: f64,
    /// Every CPU's idle time (iowait included).
    pub idle: f64,
    /// Time the host this machine runs on gave its vCPUs to others.
    pub steal: f64,
}

impl CpuSplit {
    /// The host's busy time outside this process's parts (ticks against nanoseconds: about
    /// 0.01 s a CPU either way).
    pub fn rest(&self) -> f64 {
        self.host_busy - (self.vm + self.server + self.store + self.wire + self.lab)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_parts() {
        assert_eq!(Part::of("vm-reader"), Part::Vm);
        assert_eq!(Part::of("guestmem-pool0"), Part::Server);
        assert_eq!(Part::of("guestmem-s3"), Part::Server);
        assert_eq!(Part::of("guestmem-lab"), Part::Lab);
        assert_eq!(Part::of("guestmem-lab-si"), Part::Lab);
        assert_eq!(Part::of("guestmem-prefet"), Part::Server);
        assert_eq!(Part::of("s3-server-rt"), Part::Store);
        assert_eq!(Part::of("s3-proxy-conn"), Part::Wire);
    }

    #[test]
    fn a_busy_thread_is_counted_in_its_part() {
        let before = Snapshot::take();
        let (spun_tx, spun) = std::sync::mpsc::channel::<()>();
        let (go_tx, go) = std::sync::mpsc::channel::<()>();
        let t = std::thread::Builder::new()
            .name("vm-reader".into())
            .spawn(move || {
                // 50 ms of its own CPU, however busy the host is.
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                let mut x = 0u64;
                loop {
                    // SAFETY: `ts` is a timespec the call writes.
                    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                    if ts.tv_sec > 0 || ts.tv_nsec >= 50_000_000 {
                        break;
                    }
                    x = std::hint::black_box(x.wrapping_add(1));
                }
                // Still running at the second snapshot: its time is read from its task.
                let _ = spun_tx.send(());
                let _ = go.recv();
                x
            })
            .unwrap();
        spun.recv().unwrap();
        let after = Snapshot::take();
        go_tx.send(()).unwrap();
        t.join().unwrap();
        let s = before.until(&after);
        assert!(s.vm >= 0.05, "{s:?}");
    }
}
