//! The move scenario: a running Firecracker VM (real, `../shared/firecracker`) moved between
//! two page servers on this host that stand for two hosts, with a proxy between them that
//! adds round-trip latency.
//!
//! Prepared once: guestmem's guest (`crates/guestmem-testkit/guest`, `w` writes
//! `dirty` MiB spread over its region, new bytes every time) booted with `mem_mib` MiB,
//! once per dirty size, filled, snapshotted (Full) and pushed to the store (s3s-fs on this
//! host, in this process) as the base; the base's frames fetched once into a cache folder
//! that each round's hosts start from (hard links), as a host that served the base before.
//!
//! A round, per variant (round-trip latency, dirty size):
//! 1. The source: a page server ([`guestmem::serve::Server`], one VM) of the base from the
//!    store, and a Firecracker restored from it with `track_dirty_pages`; the guest writes
//!    its dirty MiB (`w`).
//! 2. The destination: a fresh Firecracker, and [`guestmem::migrate::move_in`] on a TCP
//!    port, behind a proxy with the latency; the source serves its diff's frames on a port
//!    behind another such proxy.
//! 3. [`guestmem::migrate::move_out`]: offer, pause, Diff snapshot, frames, hand-over, load,
//!    the source Firecracker ended, the diff pushed to the store, the destination released.
//! 4. The guest, now on the destination, touches every page of its region as it resumes
//!    (`t`, sent before the move: two qwords a page, checked), while the source still owes
//!    the diff; then checks every qword (`g`).
//!
//! Reported: the pause (from `PATCH /vm Paused` on the source to the destination's word
//! that the VM runs) and its steps; the latency of the destination's GETs to the source
//! (remote fetches) and of its demand faults (the engine's); bytes sent against the diff;
//! the window of risk (the pause to the destination's release); the check's result.

mod report;
mod sample;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use guestmem::migrate::{move_in, move_out, MoveIn, MoveKey, MoveOut};
use guestmem::restore::FaultClass;
use guestmem::serve::{Listener, MemoryFile, Server, ServerConfig, Socket, Vms};
use guestmem::store::{Client, FetchPolicy, FrameCache, Frames, StoreMemory, StoreUrl};
use guestmem_testkit::firecracker::vmm::{self, Backend, Vmm};
use guestmem_testkit::s3::S3Server;

use crate::error::LabError;
use crate::object_store::Proxy;
use crate::report::LabResult;
use crate::run::{summarise, thp_mode, Protocol, RunInfo};

pub use sample::{MoveFindings, MoveResult, MoveSample, MoveVariant};

/// The scenario's name.
pub const SCENARIO: &str = "move";
const BUCKET: &str = "lab";

/// How to run the scenario (also its recorded settings).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoveLabConfig {
    /// The VM's memory, MiB.
    pub mem_mib: u64,
    /// The guest's region (filled at boot, checked after the move), MiB.
    pub region_mib: u64,
    /// What the guest writes before the move, MiB, one variant each.
    pub dirty_mib: Vec<u64>,
    /// Round trips added between the hosts, milliseconds, one variant each.
    pub rtt_ms: Vec<f64>,
    /// Whether the destination fetches the source's frames ahead of the guest, one variant
    /// each. Without, it prefetches nothing and every frame the source owes comes through a
    /// fault: what a remote fault costs shows alone (with read-ahead, the guest's check
    /// seldom reaches a frame before it does).
    #[serde(default = "both")]
    pub read_ahead: Vec<bool>,
    /// The Firecracker binary (default: the shared build).
    pub firecracker: Option<PathBuf>,
    /// Where the source's Firecracker writes the diff (`guestmem move --work-dir`): a
    /// tmpfs by default, as `/run/guestmem/move` is on a systemd host (on this host's ext4
    /// the Diff snapshot of 64 MiB took 160-190 ms, on tmpfs 43-49 ms).
    pub diff_dir: PathBuf,
    /// Where the store (s3s-fs, in this process) keeps its objects: a tmpfs by default,
    /// as the store stands for one on other machines (on this host's ext4 its inode
    /// allocations took half of both CPUs while the diff was pushed, beside the faults
    /// measured).
    #[serde(default = "shm")]
    pub store_dir: PathBuf,
    /// The store's threads' nice value (19 by default: it takes only what the two hosts'
    /// CPUs have to spare, as a store on other machines takes none of theirs; at 0 it took
    /// a third of both CPUs while the diff was pushed, and a remote fault waited 0.54-0.60
    /// ms p50 at 0 ms and 256 MiB, against 0.30-0.32 ms at 19, while the window of risk,
    /// which waits on the store, went from 0.77-0.85 s to 1.10-1.17 s).
    #[serde(default = "store_nice")]
    pub store_nice: i32,
    /// Scratch folder (removed afterwards).
    pub work_dir: PathBuf,
    /// Warm-up, rounds, order.
    pub protocol: Protocol,
    /// The command line to record.
    #[serde(skip)]
    pub command: String,
    /// THP mode (recorded).
    #[serde(default)]
    pub thp_mode: String,
}

fn store_nice() -> i32 {
    19
}

fn shm() -> PathBuf {
    PathBuf::from("/dev/shm")
}

fn both() -> Vec<bool> {
    vec![true, false]
}

impl Default for MoveLabConfig {
    fn default() -> Self {
        MoveLabConfig {
            mem_mib: 1024,
            region_mib: 512,
            dirty_mib: vec![64, 256],
            rtt_ms: vec![0.0, 0.5, 20.0],
            read_ahead: both(),
            firecracker: None,
            diff_dir: PathBuf::from(format!("/dev/shm/guestmem-lab-move-{}", std::process::id())),
            store_dir: shm(),
            store_nice: store_nice(),
            work_dir: std::env::temp_dir()
                .join(format!("guestmem-lab-move-{}", std::process::id())),
            protocol: Protocol {
                warmup: 0,
                rounds: 2,
                order: crate::run::Order::Rotate,
            },
            command: String::new(),
            thp_mode: String::new(),
        }
    }
}

fn err(what: impl std::fmt::Display) -> LabError {
    LabError::restore(what.to_string())
}

/// A client of the lab's bucket.
fn client(s3: &S3Server) -> Result<Arc<Client>, LabError> {
    let env: Vec<(&str, String)> = s3.env();
    let get = move |k: &str| -> Option<String> {
        env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    };
    Ok(Arc::new(Client::connect_with(BUCKET, &get).map_err(err)?))
}

/// A free TCP port of 127.0.0.1 (taken and let go: the lab's hosts are this one).
fn free_port() -> Result<SocketAddr, LabError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(err)?;
    l.local_addr().map_err(err)
}

/// `from`'s files hard-linked into `to`, its folders made again (a frame cache, whose
/// frames lie in fan-out folders, as a host that served it before). How many files.
fn link_cache(from: &Path, to: &Path) -> Result<u64, LabError> {
    std::fs::create_dir_all(to).map_err(err)?;
    let mut n = 0;
    for e in std::fs::read_dir(from).map_err(err)? {
        let e = e.map_err(err)?;
        let t = e.file_type().map_err(err)?;
        if t.is_dir() {
            n += link_cache(&e.path(), &to.join(e.file_name()))?;
        } else if t.is_file() {
            std::fs::hard_link(e.path(), to.join(e.file_name())).map_err(err)?;
            n += 1;
        }
    }
    Ok(n)
}

/// A base in the store: its vmstate here, its URL, its frames' cache folder.
struct Base {
    vmstate: PathBuf,
    /// Its memory file, kept for the host's check after each move.
    mem: PathBuf,
    url: StoreUrl,
    cache: PathBuf,
}

struct Lab<'a> {
    cfg: &'a MoveLabConfig,
    fc: PathBuf,
    store: Arc<Client>,
    bases: Vec<(u64, Base)>,
    moves: AtomicU64,
}

/// Runs the scenario; writes nothing but its scratch files (removed afterwards).
pub fn run_move(cfg: &MoveLabConfig) -> Result<MoveResult, LabError> {
    cfg.protocol.validate(SCENARIO)?;
    let fc = cfg
        .firecracker
        .clone()
        .unwrap_or_else(|| vmm::shared_dir().join("firecracker"));
    let missing = match fc.exists() {
        false => Some(format!("no Firecracker at {}", fc.display())),
        true => vmm::host_unavailable().or_else(vmm::guest_toolchain_missing),
    };
    if let Some(why) = missing {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: why,
        });
    }
    for &d in &cfg.dirty_mib {
        if d == 0 || !cfg.region_mib.is_multiple_of(d) || !(cfg.region_mib / d).is_power_of_two() {
            return Err(LabError::Config {
                scenario: SCENARIO,
                reason: format!(
                    "dirty {d} MiB: the region ({} MiB) over it must be a power of two",
                    cfg.region_mib
                ),
            });
        }
    }
    if cfg.region_mib + 64 > cfg.mem_mib.min(1024) {
        return Err(LabError::Config {
            scenario: SCENARIO,
            reason: "the region starts at 64 MiB and must end inside the memory and the first GiB"
                .into(),
        });
    }
    // The diffs' folder (on a tmpfs) goes too if the run is stopped by a signal.
    let _diffs = crate::stop::Tracked::new(&cfg.diff_dir);
    crate::run::in_work_dir(&cfg.work_dir, || run_in(cfg, fc))
}

fn run_in(cfg: &MoveLabConfig, fc: PathBuf) -> Result<MoveResult, LabError> {
    let run = RunInfo::collect(cfg.command.clone());
    let s3 = S3Server::try_start_niced(&cfg.store_dir, "lab-move", &[BUCKET], cfg.store_nice)
        .map_err(err)?;
    let _store = crate::stop::Tracked::new(s3.root());
    let store = client(&s3)?;
    // Every guest booted at once (their fills overlap), snapshotted, pushed, cached.
    let mut booted = Vec::new();
    for &d in &cfg.dirty_mib {
        let dir = cfg.work_dir.join(format!("base-{d}"));
        std::fs::create_dir_all(&dir).map_err(err)?;
        let guest = vmm::build_move_guest(&dir, cfg.region_mib, d).map_err(err)?;
        let vm = Vmm::start(&fc, &dir, "boot").map_err(err)?;
        vm.boot(&guest, cfg.mem_mib, false).map_err(err)?;
        booted.push((d, dir, vm));
    }
    let mut bases = Vec::new();
    for (d, dir, vm) in booted {
        vm.line("READY", Duration::from_secs(600)).map_err(err)?;
        let (vmstate, mem) = (dir.join("base.vmstate"), dir.join("base.mem"));
        vm.snapshot(&vmstate, &mem).map_err(err)?;
        drop(vm);
        let url = StoreUrl::parse(&format!("s3://{BUCKET}/base-{d}"), false).map_err(err)?;
        guestmem::store::push(
            &store,
            &guestmem::store::PushSource::Raw(mem.clone()),
            &url,
            &Default::default(),
        )
        .map_err(err)?;
        let cache = dir.join("cache");
        let frames = Frames::new(
            Arc::clone(&store),
            Some(Arc::new(
                FrameCache::open(&cache, (cfg.mem_mib << 20) * 2).map_err(err)?,
            )),
            FetchPolicy::default(),
        );
        StoreMemory::open(frames, &url)
            .map_err(err)?
            .fetch_all(8)
            .map_err(err)?;
        bases.push((
            d,
            Base {
                vmstate,
                mem,
                url,
                cache,
            },
        ));
    }
    let lab = Lab {
        cfg,
        fc,
        store,
        bases,
        moves: AtomicU64::new(0),
    };
    let mut variants = Vec::new();
    for &d in &cfg.dirty_mib {
        for &r in &cfg.rtt_ms {
            for &a in &cfg.read_ahead {
                let how = if a { "" } else { ", faults only" };
                variants.push((format!("rtt {r} ms, {d} MiB{how}"), r, d, a));
            }
        }
    }
    let samples = cfg.protocol.run(variants.len(), |i| {
        let (_, r, d, a) = &variants[i];
        lab.round(*r, *d, *a)
    })?;
    let body = variants
        .iter()
        .zip(samples)
        .map(|((n, r, d, a), samples)| MoveVariant {
            name: n.clone(),
            rtt_ms: *r,
            dirty_mib: *d,
            read_ahead: *a,
            pause_ms: summarise(&samples, |s| s.pause_ms),
            samples,
        })
        .collect();
    Ok(LabResult {
        scenario: SCENARIO.into(),
        seeds: Vec::new(),
        run,
        settings: MoveLabConfig {
            thp_mode: thp_mode(),
            ..cfg.clone()
        },
        timed: "the pause: from PATCH /vm Paused on the source to the destination's word that the \
                VM runs (loaded paused, committed, resumed)"
            .into(),
        body: MoveFindings { variants: body },
    })
}

impl Lab<'_> {
    fn round(&self, rtt_ms: f64, dirty: u64, read_ahead: bool) -> Result<MoveSample, LabError> {
        let cfg = self.cfg;
        let base = &self
            .bases
            .iter()
            .find(|(d, _)| *d == dirty)
            .expect("a base per dirty size")
            .1;
        let n = self.moves.fetch_add(1, Ordering::Relaxed);
        let dir = cfg.work_dir.join("round");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(err)?;
        let frames_at = |name: &str| -> Result<Arc<Frames>, LabError> {
            let c = dir.join(name);
            if link_cache(&base.cache, &c)? == 0 {
                return Err(err(format!("no frame in {}", base.cache.display())));
            }
            Ok(Frames::new(
                Arc::clone(&self.store),
                Some(Arc::new(
                    FrameCache::open(&c, (cfg.mem_mib << 20) * 2).map_err(err)?,
                )),
                FetchPolicy::default(),
            ))
        };
        let server_cfg = ServerConfig {
            vms: Vms::One {
                wait: Some(Duration::from_secs(60)),
            },
            handler_threads: crate::run::available_cpus(),
            prefetch_threads: crate::run::available_cpus(),
            ..ServerConfig::default()
        };

        // The source: the base served from the store, the VM restored tracking dirty pages.
        let src_sock = dir.join("src.sock");
        let memory = StoreMemory::open(frames_at("cache-src")?, &base.url).map_err(err)?;
        let src_server = Server::new(
            vec![Socket {
                listener: Listener::bind(&src_sock).map_err(err)?,
                memory: MemoryFile::from_store(memory),
                working_set: Vec::new(),
            }],
            server_cfg.clone(),
        )
        .map_err(err)?;
        let src_drain = src_server.drainer();
        let src_run = std::thread::spawn(move || src_server.run());
        let mut src = Vmm::start(&self.fc, &dir, "src").map_err(err)?;
        src.load_tracked(&base.vmstate, Backend::Uffd(&src_sock))
            .map_err(err)?;
        src.send(b'w').map_err(err)?;
        src.line("WROTE", Duration::from_secs(600)).map_err(err)?;

        // The destination, behind the latency; the source's frames too.
        let mut dst = Vmm::start(&self.fc, &dir, "dst").map_err(err)?;
        // Waiting in its stdin, read by the destination's console once the VM is loaded
        // there: the guest's touch pass (two qwords of every page) starts as it resumes,
        // while the source still owes the diff, as a VM's own work would.
        dst.send(b't').map_err(err)?;
        let listener = TcpListener::bind("127.0.0.1:0").map_err(err)?;
        let delay = Duration::from_secs_f64(rtt_ms / 1000.0);
        let ctl = Proxy::start_rtt(listener.local_addr().map_err(err)?, delay).map_err(err)?;
        let peer_at = free_port()?;
        let peer = Proxy::start_rtt(peer_at, delay).map_err(err)?;
        // Authenticated, as an operator's move across a network would be: one key for
        // both sides (drawn from the clock and the move: a lab's, not a secret).
        let key = MoveKey::from_secret(
            format!(
                "guestmem-lab move {n} at {:?}",
                std::time::SystemTime::now()
            )
            .as_bytes(),
        )
        .map_err(err)?;
        let into = MoveIn {
            api: dst.api().to_path_buf(),
            dir: dir.join("in"),
            server: ServerConfig {
                prefetch_threads: if read_ahead {
                    server_cfg.prefetch_threads
                } else {
                    0
                },
                ..server_cfg
            },
            wait: Duration::from_secs(300),
            key: Some(key.clone()),
            stop: None,
        };
        std::fs::create_dir_all(&into.dir).map_err(err)?;
        let dst_frames = frames_at("cache-dst")?;
        let incoming = std::thread::spawn(move || {
            move_in(&listener, &into, &mut |_| Ok(Arc::clone(&dst_frames)))
        });
        let out = MoveOut {
            api: dir.join("src.api.sock"),
            base: base.url.clone(),
            push_as: base.url.sibling(&format!("moved-{n}")),
            to: ctl.addr(),
            listen: peer_at,
            advertise: Some(peer.endpoint()),
            work_dir: cfg.diff_dir.clone(),
            threads: 16,
            key: Some(key),
            stop: None,
        };
        // A profile's window (`GUESTMEM_LAB_PERF_CTL`): the move, from the pause until the
        // store holds the diff and the destination let go (the window of risk, when remote
        // faults come).
        crate::run::profile_window(true);
        let moved = move_out(&out, &self.store);
        crate::run::profile_window(false);
        let r = match moved {
            Ok(r) => r,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&cfg.diff_dir);
                drop(dst);
                let _ = incoming.join();
                src_drain.drain();
                let _ = src_run.join();
                return Err(err(format!("move: {e}")));
            }
        };
        let bad_of = |line: &str| -> u64 {
            line.rsplit(' ')
                .next()
                .and_then(|b| b.parse().ok())
                .unwrap_or(u64::MAX)
        };
        let touch = dst.line("TOUCH", Duration::from_secs(900)).map_err(err)?;
        let t = Instant::now();
        dst.send(b'g').map_err(err)?;
        let pass = dst.line("PASS", Duration::from_secs(900)).map_err(err)?;
        let check_secs = t.elapsed().as_secs_f64();
        let bad = bad_of(&touch).saturating_add(bad_of(&pass));
        // Every other page, by the host: the VM's memory written out whole (a Full
        // snapshot; the pages the guest never read come through the destination's server
        // too) against the base's file. In the region only the pages `w` wrote differ;
        // outside it every page is the base's but the low MiB (boot structures, the
        // hypervisor's own pages) and the guest program's image (its data and stack).
        let wrong = if bad == 0 {
            let after = dir.join("after.mem");
            dst.snapshot(&dir.join("after.vmstate"), &after)
                .map_err(err)?;
            let differ = vmm::pages_differing(&base.mem, &after).map_err(err)?;
            let _ = std::fs::remove_file(&after);
            vmm::stray_pages(&differ, cfg.region_mib, dirty * 256)
        } else {
            None
        };
        drop(dst);
        drop(src);
        let arrived = incoming
            .join()
            .map_err(|_| err("move-in panicked"))?
            .map_err(err)?;
        src_drain.drain();
        let _ = src_run.join();
        let miss = arrived
            .server
            .as_ref()
            .and_then(|s| s.status.sockets.first())
            .map(|k| k.fault_latency.class(FaultClass::File).clone())
            .unwrap_or_default();
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&cfg.diff_dir);
        if bad != 0 {
            return Err(err(format!(
                "after the move (rtt {rtt_ms} ms, {dirty} MiB) the guest said {touch:?}, {pass:?}"
            )));
        }
        if let Some(wrong) = wrong {
            return Err(err(format!(
                "after the move (rtt {rtt_ms} ms, {dirty} MiB) the host found {wrong}"
            )));
        }
        let p = &r.pause;
        Ok(MoveSample {
            pause_ms: p.total_ms,
            step_pause_ms: p.pause_ms,
            snapshot_ms: p.snapshot_ms,
            frames_ms: p.frames_ms,
            send_ms: p.send_ms,
            wait_ms: p.wait_ms,
            open_ms: p.open_ms,
            load_ms: p.load_ms,
            commit_ms: p.commit_ms,
            diff_bytes: r.diff_bytes,
            bytes_sent: r.bytes_sent,
            remote_gets: arrived.peer_gets,
            remote_p50_us: arrived.peer_latency.p50_us,
            remote_p99_us: arrived.peer_latency.p99_us,
            fault_gets: arrived.peer_fault_latency.count,
            fault_get_p50_us: arrived.peer_fault_latency.p50_us,
            fault_get_p99_us: arrived.peer_fault_latency.p99_us,
            remote_faults: arrived.peer_fault_wait.count,
            remote_fault_p50_us: arrived.peer_fault_wait_exact.p50_us,
            remote_fault_p99_us: arrived.peer_fault_wait_exact.p99_us,
            miss_p50_us: miss.p50_us,
            miss_p99_us: miss.p99_us,
            risk_ms: r.risk_ms,
            push_secs: r.push.wall_secs,
            check_secs,
            bad,
        })
    }
}
