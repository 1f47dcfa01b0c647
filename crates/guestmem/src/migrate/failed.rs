//! Moves that fail past the pause, against a real S3 server, a stand-in for Firecracker's
//! API (an HTTP responder on a unix socket that writes a Diff as Firecracker does: a
//! vmstate and a sparse memory file) and a stand-in destination speaking the move's wire
//! protocol. Whatever fails after the Diff, its writes are pushed as the next move's base
//! and the error says so: Firecracker cleared its dirty log, and a later move on the old
//! base would restore stale pages.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use guestmem_testkit::s3::S3Server;

use super::out::{move_out, MoveOut};
use super::wire::{Msg, Side, Wire, WIRE_VERSION};
use crate::store::{pull, push, Client, FetchPolicy, Frames, PushSource, StoreMemory, StoreUrl};

const MIB: usize = 1 << 20;
/// The VM's memory.
const MEM: usize = 8 * MIB;
/// The pages the Diff holds (offsets), and the byte each is filled with.
const WRITTEN: [(usize, u8); 3] = [(0, 0xa1), (3 * MIB + 4096, 0xb2), (7 * MIB, 0xc3)];

/// How the stand-in Firecracker answers `PUT /snapshot/create`.
#[derive(Clone, Copy, PartialEq)]
enum Create {
    /// Writes the Diff, answers 204.
    Writes,
    /// Writes part of the memory file, answers 400 (a disk that filled).
    FailsMidway,
}

/// A stand-in for Firecracker's API at `path`: the requests it was sent, in order
/// (`METHOD path [state]`).
fn firecracker_api(path: &Path, create: Create) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let listener = UnixListener::bind(path).unwrap();
    let log = Arc::clone(&seen);
    std::thread::spawn(move || {
        for s in listener.incoming() {
            let Ok(mut s) = s else { return };
            // `Api::open` connects only to learn who answers, and sends nothing.
            let Some((line, body)) = read_request(&s) else {
                continue;
            };
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            let mut words = line.split_whitespace();
            let (method, at) = (words.next().unwrap(), words.next().unwrap());
            let code = match at {
                "/snapshot/create" => {
                    let file = |k: &str| PathBuf::from(body[k].as_str().unwrap());
                    std::fs::write(file("snapshot_path"), b"vmstate").unwrap();
                    let mem = std::fs::File::create(file("mem_file_path")).unwrap();
                    mem.set_len(MEM as u64).unwrap();
                    let n = match create {
                        Create::Writes => WRITTEN.len(),
                        Create::FailsMidway => 1,
                    };
                    for &(at, b) in &WRITTEN[..n] {
                        mem.write_all_at(&[b; 4096], at as u64).unwrap();
                    }
                    match create {
                        Create::Writes => 204,
                        Create::FailsMidway => 400,
                    }
                }
                _ => 204,
            };
            let state = body["state"].as_str().unwrap_or("");
            log.lock()
                .unwrap()
                .push(format!("{method} {at} {state}").trim().to_string());
            let _ = write!(s, "HTTP/1.1 {code} X\r\nContent-Length: 0\r\n\r\n");
        }
    });
    seen
}

/// One HTTP/1.1 request from `s`: its request line and body; `None` for a connection that
/// sends nothing.
fn read_request(s: &std::os::unix::net::UnixStream) -> Option<(String, Vec<u8>)> {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    if r.read_line(&mut line).unwrap_or(0) == 0 {
        return None;
    }
    let mut len = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        if h.trim().is_empty() {
            break;
        }
        if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap();
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    Some((line, body))
}

/// What the stand-in destination does after the source's Commit.
#[derive(Clone, Copy)]
enum AfterCommit {
    /// Says it could not resume the VM.
    Refuses,
    /// Closes the connection without a word.
    Closes,
}

/// A stand-in destination on 127.0.0.1: takes the offer, the vmstate and the chain, says
/// the VM is loaded, then `after` the Commit; or, when the source aborts, reads that.
fn destination(after: AfterCommit) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let limit = Duration::from_secs(30);
        let (s, _) = l.accept().unwrap();
        let mut w = Wire::new(s).unwrap();
        w.hello(Side::Destination, None, limit).unwrap();
        assert!(matches!(w.recv(limit).unwrap(), Msg::Offer { .. }));
        w.send(
            &Msg::Ready {
                version: WIRE_VERSION,
            },
            &[],
        )
        .unwrap();
        let n = match w.recv(limit).unwrap() {
            Msg::State { vmstate_bytes } => vmstate_bytes,
            Msg::Abort { .. } => return,
            other => panic!("{other:?}"),
        };
        w.payload("vmstate", n, limit).unwrap();
        let Msg::Diff { manifest_bytes, .. } = w.recv(limit).unwrap() else {
            panic!("no chain");
        };
        w.payload("manifest", manifest_bytes, limit).unwrap();
        w.send(
            &Msg::Loaded {
                load_ms: 1.0,
                open_ms: 1.0,
            },
            &[],
        )
        .unwrap();
        assert!(matches!(w.recv(limit).unwrap(), Msg::Commit));
        match after {
            AfterCommit::Refuses => {
                let reason = "PATCH /vm Resumed: HTTP 400 (the test's)".into();
                w.send(&Msg::Refused { reason }, &[]).unwrap();
                // Until the source has done with the connection.
                let _ = w.recv(limit);
            }
            AfterCommit::Closes => {}
        }
    });
    addr
}

struct Rig {
    _scratch: guestmem_testkit::Scratch,
    dir: PathBuf,
    s3: S3Server,
    store: Arc<Client>,
}

impl Rig {
    /// A base of `MEM` bytes in a real S3 server, as `s3://snaps/base`; `None` (the skip
    /// recorded) where the temporary folder cannot hold a Diff (the move refuses there
    /// before it pauses).
    fn new(name: &str) -> Option<Rig> {
        let scratch = guestmem_testkit::Scratch::new(name);
        if let Err(e) = crate::store::check_diff_folder(&scratch) {
            guestmem_testkit::skip(e);
            return None;
        }
        let dir = scratch.to_path_buf();
        let s3 = S3Server::start(name, &["snaps"]);
        let env = s3.env();
        let get = move |k: &str| env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone());
        let store = Arc::new(Client::connect_with("snaps", &get).unwrap());
        let base = dir.join("base.mem");
        std::fs::write(&base, base_bytes()).unwrap();
        push(
            &store,
            &PushSource::Raw(base),
            &url("base"),
            &Default::default(),
        )
        .unwrap();
        Some(Rig {
            _scratch: scratch,
            dir,
            s3,
            store,
        })
    }

    /// Moves the VM behind a stand-in API that answers `create` to a stand-in destination
    /// that does `after`, as `push_as`: the move's error, and the API's requests.
    fn fail(&self, create: Create, after: AfterCommit, push_as: &str) -> (String, Vec<String>) {
        self.fail_or_stop(create, after, push_as, None)
    }

    /// [`Rig::fail`], with the move's stop.
    fn fail_or_stop(
        &self,
        create: Create,
        after: AfterCommit,
        push_as: &str,
        stop: Option<Arc<std::os::fd::OwnedFd>>,
    ) -> (String, Vec<String>) {
        // (A socket's path is at most 107 bytes: a name's first 16 bytes.)
        let api = self
            .dir
            .join(format!("{}.api.sock", &push_as[..push_as.len().min(16)]));
        let seen = firecracker_api(&api, create);
        let m = MoveOut {
            api,
            base: url("base"),
            push_as: url(push_as),
            to: destination(after),
            listen: "127.0.0.1:0".parse().unwrap(),
            advertise: None,
            work_dir: self.dir.join("work"),
            threads: 1,
            key: None,
            stop,
        };
        let e = move_out(&m, &self.store).expect_err("the move failed");
        let seen = seen.lock().unwrap().clone();
        (e.to_string(), seen)
    }

    /// The memory of `name` in the store, pulled.
    fn pulled(&self, name: &str) -> Vec<u8> {
        let frames = Frames::new(Arc::clone(&self.store), None, FetchPolicy::default());
        let memory = StoreMemory::open(frames, &url(name)).unwrap();
        let out = self.dir.join(format!("{name}.pulled"));
        pull(&memory, &out, 1).unwrap();
        std::fs::read(out).unwrap()
    }
}

fn url(name: &str) -> StoreUrl {
    StoreUrl::parse(&format!("s3://snaps/{name}"), false).unwrap()
}

fn base_bytes() -> Vec<u8> {
    (0..MEM).map(|i| (i / 4096 % 251) as u8 + 1).collect()
}

/// What Firecracker is asked when a move fails past the Diff and the VM resumes here.
const RESUMED: [&str; 3] = [
    "PATCH /vm Paused",
    "PUT /snapshot/create",
    "PATCH /vm Resumed",
];

/// The base with the Diff's pages laid over.
fn moved_bytes() -> Vec<u8> {
    let mut m = base_bytes();
    for &(at, b) in &WRITTEN {
        m[at..at + 4096].fill(b);
    }
    m
}

/// A move asked to stop before its pause pauses nothing, and says so to both sides.
#[test]
fn a_move_asked_to_stop_before_the_pause_pauses_nothing() {
    let Some(rig) = Rig::new("move-stopped") else {
        return;
    };
    let stop = Arc::new(crate::sys::eventfd().unwrap());
    crate::sys::eventfd_signal(std::os::fd::AsFd::as_fd(&*stop)).unwrap();
    let (e, seen) = rig.fail_or_stop(Create::Writes, AfterCommit::Closes, "moved", Some(stop));
    assert!(e.contains("asked to stop before the pause"), "{e}");
    assert!(seen.is_empty(), "{seen:?}");
}

/// A name the store takes but a file here cannot (past 255 bytes) is refused before the
/// pause: Firecracker's Diff would have failed in it, its dirty log spent.
#[test]
fn a_name_too_long_for_a_file_here_is_refused_before_the_pause() {
    let Some(rig) = Rig::new("move-long-name") else {
        return;
    };
    let name = "n".repeat(300);
    let (e, seen) = rig.fail(Create::Writes, AfterCommit::Closes, &name);
    assert!(
        e.contains("write a diff to") && e.contains("too long"),
        "{e}"
    );
    assert!(seen.is_empty(), "{seen:?}");
}

/// The destination could not resume the VM after the commit: the source resumes its copy,
/// pushes the Diff as `--as`, and says the next move's base is that.
#[test]
fn a_move_refused_after_the_commit_pushes_its_writes_as_the_next_base() {
    let Some(rig) = Rig::new("move-refused-after-commit") else {
        return;
    };
    let (e, seen) = rig.fail(Create::Writes, AfterCommit::Refuses, "moved");
    assert!(e.contains("could not resume"), "{e}");
    assert!(e.contains("--base s3://snaps/moved"), "{e}");
    assert_eq!(seen, RESUMED, "{e}");
    assert!(rig.pulled("moved") == moved_bytes(), "the pushed diff");
    assert!(
        !rig.dir.join("work/moved.mem").exists(),
        "the Diff was kept"
    );
    drop(rig.s3);
}

/// The destination went silent after the commit: the source's copy stays paused (the
/// destination may run the VM), and the Diff is pushed as `--as` all the same.
#[test]
fn a_move_unconfirmed_after_the_commit_stays_paused_and_pushes_its_writes() {
    let Some(rig) = Rig::new("move-unconfirmed") else {
        return;
    };
    let (e, seen) = rig.fail(Create::Writes, AfterCommit::Closes, "moved");
    assert!(e.contains("left paused"), "{e}");
    assert!(e.contains("--base s3://snaps/moved"), "{e}");
    assert_eq!(seen, RESUMED[..2], "{e}");
    assert!(rig.pulled("moved") == moved_bytes(), "the pushed diff");
}

/// Firecracker's Diff failed midway (it may have cleared its dirty log): the VM resumes on
/// the source, and the error says the base no longer holds what the VM wrote.
#[test]
fn a_diff_that_failed_midway_says_the_base_needs_a_full_snapshot() {
    let Some(rig) = Rig::new("move-diff-failed") else {
        return;
    };
    let (e, seen) = rig.fail(Create::FailsMidway, AfterCommit::Closes, "moved");
    assert!(e.contains("push a Full snapshot"), "{e}");
    assert!(e.contains("s3://snaps/base"), "{e}");
    assert_eq!(seen, RESUMED, "{e}");
    assert!(!rig.dir.join("work/moved.mem").exists());
}

/// Environment variables that make the lib's test binary a stand-in destination Firecracker
/// whose `snapshot/load` never answers ([`standin_hanging_loader`]).
const HANGING_API: &str = "GM_TEST_HANGING_API";
const HANGING_MARK: &str = "GM_TEST_HANGING_MARK";

/// Not a test of its own: run as a child process by
/// [`a_move_in_asked_to_stop_during_the_load_ends_its_copy_and_the_source_resumes`], a
/// stand-in destination Firecracker (a process of its own, for move-in ends it through its
/// pidfd) whose `snapshot/load` never answers; it writes the mark file when asked to load.
#[test]
fn standin_hanging_loader() {
    let Ok(path) = std::env::var(HANGING_API) else {
        return;
    };
    let mark = std::env::var(HANGING_MARK).expect("the mark's path");
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(|| {
        // Never left behind: gone within a minute whatever the parent does.
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(0);
    });
    for s in listener.incoming() {
        let Ok(mut s) = s else { return };
        // `Api::open` connects only to learn who answers, and sends nothing.
        let Some((line, _)) = read_request(&s) else {
            continue;
        };
        if line.contains("/snapshot/load") {
            std::fs::write(&mark, b"").unwrap();
            // Never answered: the load hangs.
            std::thread::sleep(Duration::from_secs(60));
        }
        let _ = write!(s, "HTTP/1.1 204 X\r\nContent-Length: 0\r\n\r\n");
    }
}

/// A move-in asked to stop while its Firecracker's load hangs ends that copy (its
/// process, through its pidfd) at once and refuses the move, not 120 s later; the source,
/// told, resumes its VM.
#[test]
fn a_move_in_asked_to_stop_during_the_load_ends_its_copy_and_the_source_resumes() {
    let Some(rig) = Rig::new("move-in-stop-load") else {
        return;
    };
    let api_in = rig.dir.join("in.api.sock");
    let mark = rig.dir.join("load-asked");
    let mut loader = guestmem_testkit::ChildGuard::new(
        std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "migrate::failed::standin_hanging_loader",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(HANGING_API, &api_in)
            .env(HANGING_MARK, &mark)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t0 = std::time::Instant::now();
    while !api_in.exists() {
        assert!(t0.elapsed() < Duration::from_secs(30), "no stand-in API");
        std::thread::sleep(Duration::from_millis(10));
    }
    let dir_in = rig.dir.join("in");
    super::private_dir(&dir_in).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let to = listener.local_addr().unwrap();
    let stop = Arc::new(crate::sys::eventfd().unwrap());
    let into = super::MoveIn {
        api: api_in,
        dir: dir_in.clone(),
        server: crate::serve::ServerConfig {
            vms: crate::serve::Vms::One {
                wait: Some(Duration::from_secs(10)),
            },
            ..Default::default()
        },
        wait: Duration::from_secs(30),
        key: None,
        stop: Some(Arc::clone(&stop)),
    };
    let store = Arc::clone(&rig.store);
    let moving_in = std::thread::spawn(move || {
        super::move_in(&listener, &into, &mut |_| {
            Ok(Frames::new(
                Arc::clone(&store),
                None,
                FetchPolicy::default(),
            ))
        })
    });
    let api_out = rig.dir.join("out.api.sock");
    let seen = firecracker_api(&api_out, Create::Writes);
    let out = MoveOut {
        api: api_out,
        base: url("base"),
        push_as: url("moved"),
        to,
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        work_dir: rig.dir.join("work"),
        threads: 1,
        key: None,
        stop: None,
    };
    let store = Arc::clone(&rig.store);
    let moving_out = std::thread::spawn(move || move_out(&out, &store));
    let t0 = std::time::Instant::now();
    while !mark.exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "no load asked for");
        assert!(!moving_in.is_finished(), "{:?}", moving_in.join());
        std::thread::sleep(Duration::from_millis(10));
    }
    // The chain comes right behind the vmstate: once it is here, move-in waits on the load
    // alone (a stop before it is the wait on the source's, another path).
    std::thread::sleep(Duration::from_millis(1000));
    crate::sys::eventfd_signal(std::os::fd::AsFd::as_fd(&*stop)).unwrap();
    let asked = std::time::Instant::now();
    let e = moving_in.join().unwrap().expect_err("the move was refused");
    assert!(
        e.to_string()
            .contains("asked to stop during Firecracker's load"),
        "{e}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "the stop waited on the load: {:?}",
        asked.elapsed()
    );
    let e = moving_out.join().unwrap().expect_err("the move failed");
    assert!(e.to_string().contains("asked to stop"), "{e}");
    assert_eq!(*seen.lock().unwrap(), RESUMED, "the source's VM resumed");
    // Its copy was ended, and nothing of the move is left in its folder.
    let t0 = std::time::Instant::now();
    while loader.running() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the copy was not ended"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let left: Vec<_> = std::fs::read_dir(&dir_in).unwrap().flatten().collect();
    assert!(left.is_empty(), "{left:?}");
}
