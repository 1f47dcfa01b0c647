//! One round of the firecracker scenario: one restore of one variant in one page-cache
//! state, into a fresh Firecracker process, its server started before and ended after.

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem::serve::{
    Listener, MemoryFile, ServeError, ServeLog, Server as PageServer, ServerConfig, ServerReport,
    Socket, Vms,
};

use super::host::{cached_share, drop_cache, warm};
use super::{
    err, failed, Cache, Ctx, FcSample, ServerSample, Variant, PASS_LIMIT, SCENARIO, SOCKET_LIMIT,
};
use crate::error::LabError;
use guestmem_testkit::firecracker::vmm::{self, Backend, Vmm};
use guestmem_testkit::ChildGuard as Reaped;

/// What serves a restore's memory, started before the VM loads; dropped, a handler
/// process is killed (before the VM, which is declared first).
enum Server {
    /// Firecracker maps the file itself.
    File,
    /// Firecracker's example handler process.
    Handler(Reaped),
    /// guestmem's page server on a thread, and when its handshake arrived.
    Guestmem {
        thread: JoinHandle<Result<ServerReport, ServeError>>,
        handshake: Arc<Mutex<Option<Instant>>>,
    },
}

impl Server {
    /// Starts `v`'s server for `mem` on `socket` and waits for it to listen.
    fn start(ctx: &Ctx<'_>, v: Variant, socket: &Path, mem: &Path) -> Result<Server, LabError> {
        let what = v.name();
        if let Some(handler) = v.handler() {
            let bin = ctx.fc.parent().unwrap_or(Path::new(".")).join(handler);
            let child = Command::new(bin)
                .arg(socket)
                .arg(mem)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(failed(what))?;
            let h = Reaped::new(child);
            vmm::wait_listening(socket, SOCKET_LIMIT).map_err(failed(what))?;
            return Ok(Server::Handler(h));
        }
        if v == Variant::File {
            return Ok(Server::File);
        }
        let listener = Listener::bind(socket).map_err(err)?;
        let memory = MemoryFile::open(mem).map_err(err)?;
        let handshake = Arc::new(Mutex::new(None));
        let seen = handshake.clone();
        // As `guestmem serve-uffd --once` serves by default: one prefetch thread (none for
        // the faults-only variant, as `--prefetch-threads 0`).
        let scfg = ServerConfig {
            handler_threads: ctx.cfg.server_threads,
            prefetch_threads: usize::from(v != Variant::Guestmem4kFaults),
            regain_huge: v != Variant::Guestmem4kNoRegain,
            vms: Vms::One {
                wait: Some(SOCKET_LIMIT),
            },
            // Its one line on admitting the VM: "session 0: peer PID on socket 0 sent N
            // regions (M MiB)".
            log: ServeLog::to(move |line: &str| {
                if line.starts_with("session ") && line.contains(" sent ") {
                    seen.lock()
                        .expect("not poisoned")
                        .get_or_insert(Instant::now());
                }
            }),
            ..ServerConfig::default()
        };
        let server = PageServer::new(
            vec![Socket {
                listener,
                memory,
                working_set: Vec::new(),
            }],
            scfg,
        )
        .map_err(err)?;
        let thread = std::thread::Builder::new()
            .name(format!("{what}-server"))
            .spawn(move || server.run())
            .map_err(failed(what))?;
        Ok(Server::Guestmem { thread, handshake })
    }

    /// Ends the round: a handler first (it takes a closed VM socket for a new VM, panics and
    /// kills its peer), then the VM; guestmem's server ends with its VM and reports.
    fn finish(self, vm: Vmm, t0: Instant) -> Result<Option<ServerSample>, LabError> {
        match self {
            Server::File => Ok(None),
            Server::Handler(h) => {
                drop(h);
                drop(vm);
                Ok(None)
            }
            Server::Guestmem { thread, handshake } => {
                drop(vm);
                let r = thread
                    .join()
                    .map_err(|_| err("guestmem's page server panicked"))?
                    .map_err(err)?;
                let at = *handshake.lock().expect("not poisoned");
                server_sample(
                    &r,
                    at.map(|a| a.saturating_duration_since(t0).as_secs_f64()),
                )
                .map(Some)
            }
        }
    }
}

/// The server's report, its phases put on the load's clock (`handshake` seconds after it).
fn server_sample(r: &ServerReport, handshake: Option<f64>) -> Result<ServerSample, LabError> {
    let e = &r
        .last
        .as_ref()
        .ok_or_else(|| err("guestmem's page server served no VM"))?
        .engine;
    let after = |s: Option<f64>| Some(handshake? + s?);
    Ok(ServerSample {
        handshake_secs: handshake,
        first_fault_secs: after(e.first_fault_secs),
        all_in_secs: after(e.complete_secs),
        faults: e.faults,
        fault_blocks: e.fault_blocks + e.prefetched_blocks,
        blocks: e.blocks,
        bytes_copied: e.bytes_copied,
    })
}

/// Minor and major page faults of a process so far (`/proc/PID/stat`).
fn faults_of(pid: u32) -> (u64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    (
        f.get(7).copied().unwrap_or(0),
        f.get(9).copied().unwrap_or(0),
    )
}

/// One restore of `v` in cache state `cache` (the `k`-th of the run); `check`: `g` too.
pub(super) fn measure(
    ctx: &Ctx<'_>,
    (v, cache): (Variant, Cache),
    check: bool,
    k: usize,
) -> Result<FcSample, LabError> {
    let name = format!("{}-{}-{k}", v.name(), cache.name());
    let what = format!("{} ({})", v.name(), cache.name());
    let snap = match v.huge() {
        true => ctx.huge.as_ref(),
        false => ctx.small.as_ref(),
    }
    .expect("booted for its variants");
    match cache {
        Cache::Warm => warm(&snap.mem),
        Cache::Cold => drop_cache(&snap.mem),
    }
    .map_err(failed(&what))?;
    let cached_before = cached_share(&snap.mem).map_err(failed(&what))?;
    let socket = ctx.cfg.work_dir.join(format!("{name}.uffd.sock"));
    let mut vm = Vmm::start(ctx.fc, &ctx.cfg.work_dir, &name).map_err(failed(&what))?;
    // Declared after the VM: on an early return it is dropped (a handler killed) first.
    let server = Server::start(ctx, v, &socket, &snap.mem)?;
    let backend = match v {
        Variant::File => Backend::File(&snap.mem),
        _ => Backend::Uffd(&socket),
    };
    let t0 = Instant::now();
    vm.load(&snap.vmstate, backend).map_err(failed(&what))?;
    let load_secs = t0.elapsed().as_secs_f64();
    vm.send(b't').map_err(failed(&what))?;
    let touch = vm.line("TOUCH", PASS_LIMIT).map_err(failed(&what))?;
    let touch_secs = t0.elapsed().as_secs_f64();
    let (vmm_minor_faults, vmm_major_faults) = faults_of(vm.pid());
    let huge_at_touch = huge_now(vm.pid());
    verdict(&vm, &touch, &what)?;
    // guestmem's server collapses the VM's memory to huge pages once all of it is in and
    // `REGAIN_SETTLE` has passed, mostly after the first full touch: let it end first, so
    // that the next pass is the guest's own work with nothing beside it.
    let huge_before_resident = match v.regains() {
        true => wait_collapse_end(vm.pid()),
        false => huge_now(vm.pid()),
    };
    // The same pass again, every page now resident and mapped: the guest's own work, which
    // the first pass also did; the first less this one is what the restore cost the guest.
    let again = Instant::now();
    vm.send(b't').map_err(failed(&what))?;
    let touch = vm.line("TOUCH", PASS_LIMIT).map_err(failed(&what))?;
    let resident_secs = again.elapsed().as_secs_f64();
    verdict(&vm, &touch, &what)?;
    if check {
        vm.send(b'g').map_err(failed(&what))?;
        let pass = vm.line("PASS", PASS_LIMIT).map_err(failed(&what))?;
        verdict(&vm, &pass, &what)?;
    }
    let server = server.finish(vm, t0)?;
    let _ = std::fs::remove_file(&socket);
    Ok(FcSample {
        load_secs,
        touch_secs,
        resident_secs,
        cached_before,
        checked: check,
        vmm_minor_faults,
        vmm_major_faults,
        huge_at_touch,
        huge_before_resident,
        server,
    })
}

/// Bytes transparent huge pages map in the large mappings (guest memory) of process `pid`.
fn huge_now(pid: u32) -> u64 {
    guestmem::inspect::inspect_process(Some(pid), 64 << 20)
        .map_or(0, |m| m.iter().map(|m| m.huge).sum())
}

/// How long [`wait_collapse_end`] waits at most for a collapse to begin, past its settle.
const COLLAPSE_START_LIMIT: Duration = Duration::from_secs(3);
/// How long it waits at most for one to end.
const COLLAPSE_END_LIMIT: Duration = Duration::from_secs(30);
/// How often it looks, and how long huge pages must stay unchanged to count as ended.
const COLLAPSE_POLL: Duration = Duration::from_millis(250);

/// Waits until the server's collapse of process `pid`'s memory has ended: its huge pages
/// grew past what they were on entry and then stayed the same for a poll (the collapse
/// rests at most 50 ms between chunks); or none came within the settle and
/// [`COLLAPSE_START_LIMIT`] (a restore that never completed, or a kernel that refused every
/// chunk); or [`COLLAPSE_END_LIMIT`] passed. The huge pages then.
fn wait_collapse_end(pid: u32) -> u64 {
    let t = Instant::now();
    let base = huge_now(pid);
    let mut last = base;
    loop {
        std::thread::sleep(COLLAPSE_POLL);
        let now = huge_now(pid);
        let waited = t.elapsed();
        let ended = now > base && now == last;
        let none = now == base && waited > guestmem::restore::REGAIN_SETTLE + COLLAPSE_START_LIMIT;
        if ended || none || waited > COLLAPSE_END_LIMIT {
            return now;
        }
        last = now;
    }
}

/// Fails unless the guest's `TOUCH` or `PASS` line says `BAD 0`, with its `FIRSTBAD` line.
fn verdict(vm: &Vmm, line: &str, what: &str) -> Result<(), LabError> {
    if line.ends_with(" BAD 0") {
        return Ok(());
    }
    let first = vm
        .line("FIRSTBAD", Duration::from_secs(5))
        .unwrap_or_default();
    Err(err(format!(
        "{SCENARIO} {what}: the restored guest found wrong memory: {line:?} {first}"
    )))
}
