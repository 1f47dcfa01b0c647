//! The page server (`guestmem::serve`) in this process, against the Firecracker stand-in
//! (`guestmem_testkit::firecracker`: Firecracker's exact handshake): one server, one VM or
//! many; every page read back and compared with the memory file; a balloon's removes;
//! refusals typed, naming what is wrong; VMs that cannot be served ended through their
//! pidfd (stand-ins in child processes, so that the kill is real); draining; limits;
//! prefetch; learnt working sets; a memory file changed while served; huge pages regained.
//! What only a process shows (signals, exit codes, a `kill -9`, a hand-over between
//! processes, systemd) is tested through `guestmem serve-uffd` in the CLI's tests.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use guestmem::serve::{
    Drainer, HandshakeError, Listener, MemoryFile, MemoryFileProblem, OnFailure, ServeError,
    ServeLog, Server, ServerConfig, ServerReport, SessionEnd, Socket, StatusHandle, Vms,
};
use guestmem_testkit::firecracker::{
    memory_file, missing_uffd, vm_child, word, ChildDoes, Standin, CHILD_REFUSED, PAGE,
};
use guestmem_testkit::{standin_child_test, ChildGuard, Scratch};

const MIB: usize = 1 << 20;

standin_child_test!();

macro_rules! need_uffd {
    () => {
        guestmem_testkit::skip_unless!(missing_uffd());
    };
}

/// A fresh folder for one test, removed when dropped.
fn dir(name: &str) -> Scratch {
    Scratch::new(&format!("serve-lib-{name}"))
}

/// A server running on a thread of this process, and what it logged.
struct Running {
    thread: JoinHandle<Result<ServerReport, ServeError>>,
    drainer: Drainer,
    status: StatusHandle,
    log: Arc<Mutex<Vec<String>>>,
}

impl Running {
    /// Starts a server of `sockets` (socket path, memory file, working set) set by `cfg`
    /// (its log captured).
    fn start(sockets: &[(&Path, &Path)], cfg: ServerConfig) -> Running {
        Running::start_with(sockets, cfg, |_| ()).0
    }

    /// [`Running::start`], with what `before` takes from the server before it runs.
    fn start_with<T>(
        sockets: &[(&Path, &Path)],
        cfg: ServerConfig,
        before: impl FnOnce(&Server) -> T,
    ) -> (Running, T) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let lines = log.clone();
        let cfg = ServerConfig {
            log: ServeLog::to(move |l: &str| lines.lock().unwrap().push(l.to_string())),
            ..cfg
        };
        let sockets = sockets
            .iter()
            .map(|(s, m)| Socket {
                listener: Listener::bind(s).unwrap(),
                memory: MemoryFile::open(m).unwrap(),
                working_set: Vec::new(),
            })
            .collect();
        let server = Server::new(sockets, cfg).unwrap();
        let (drainer, status) = (server.drainer(), server.status());
        let taken = before(&server);
        let running = Running {
            thread: std::thread::spawn(move || server.run()),
            drainer,
            status,
            log,
        };
        (running, taken)
    }

    /// Waits (at most 20 s) for the server to return; what it returned and logged.
    fn join(self) -> (Result<ServerReport, ServeError>, String) {
        let t = Instant::now();
        while !self.thread.is_finished() {
            assert!(t.elapsed() < Duration::from_secs(20), "the server runs on");
            std::thread::sleep(Duration::from_millis(5));
        }
        let r = self.thread.join().expect("the server panicked");
        let log = self.log.lock().unwrap().join("\n");
        (r, log)
    }

    /// Drains it, then [`Running::join`].
    fn drain(self) -> (Result<ServerReport, ServeError>, String) {
        self.drainer.drain();
        self.join()
    }

    /// Its control socket at `path`, answered until the second value drops.
    fn control(&self, path: &Path) -> (PathBuf, guestmem::serve::Exposed) {
        let l = Listener::bind_private(path).unwrap();
        let exposed = self.status.serve_control(l, self.drainer.clone()).unwrap();
        (path.to_path_buf(), exposed)
    }

    /// What it logged so far.
    fn logged(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

/// A server of a memory file of `size` bytes in `dir(name)` that only faults bring in
/// (no prefetch), with a control socket: its folder, VM socket, the server, the control
/// socket's path and what serves it.
fn faults_only_with_control(
    name: &str,
    size: usize,
) -> (Scratch, PathBuf, Running, PathBuf, guestmem::serve::Exposed) {
    let d = dir(name);
    let mem = memory_file(&d, size, None);
    let socket = d.join("uffd.sock");
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            prefetch_threads: 0,
            ..leave()
        },
    );
    let (control, exposed) = srv.control(&d.join("ctl.sock"));
    (d, socket, srv, control, exposed)
}

/// A one-VM server's settings.
fn one(cfg: ServerConfig) -> ServerConfig {
    ServerConfig {
        vms: Vms::One {
            wait: Some(Duration::from_secs(10)),
        },
        ..cfg
    }
}

/// The stand-ins are threads of this process: a server could not end them (it refuses to
/// kill its own process) and says so; these tests leave them instead.
fn leave() -> ServerConfig {
    ServerConfig {
        on_failure: OnFailure::Leave,
        handler_threads: 2,
        ..ServerConfig::default()
    }
}

/// A remove is applied before any thread can read the fault that follows it: the balloon
/// takes a block's first page, the VM touches the block's ninth at once, and the first page
/// reads zero, every block. Before, the thread that read the remove re-armed the VM first,
/// and another thread could read the touch and fill the whole block, the removed page with
/// the snapshot's bytes (the balloon's memory back), before the remove was marked.
#[test]
fn a_touch_right_after_a_remove_never_fills_the_removed_page() {
    need_uffd!();
    const SIZE: usize = 64 * MIB;
    let d = dir("remove-then-touch");
    let mem = memory_file(&d, SIZE, None);
    let socket = d.join("uffd.sock");
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            prefetch_threads: 0,
            handler_threads: 4,
            ..leave()
        }),
    );
    let mut vm = Standin::new(&[SIZE], true).unwrap();
    vm.connect(&socket).unwrap();
    let mut filled = Vec::new();
    for b in 0..SIZE / MIB {
        let start = b * MIB;
        vm.remove(start, PAGE).unwrap();
        let at = start + 8 * PAGE;
        assert_eq!(vm.word(at), word(at as u64));
        if vm.word(start) != 0 {
            filled.push(start);
        }
    }
    vm.disconnect();
    let (r, log) = srv.join();
    assert_eq!(r.unwrap().last.expect("its VM").engine.removes, 64, "{log}");
    assert!(
        filled.is_empty(),
        "removed pages filled with the snapshot's bytes at {filled:#x?}"
    );
}

/// A remove that comes in while a fault's block is being copied never leaves the removed
/// page holding the snapshot's bytes. The balloon takes a block's first page while the VM
/// touches the block's ninth, both at once, every block, 4 times. Before, a copy that
/// started between the remove's read and its marking (or retried after `EAGAIN` with what
/// it had read) could install the page after the remove's zap: 1 run in 6 beside a busy
/// loop. Now, once a VM has removed a page, its copies and the reads of its removes are
/// kept apart (the userfaultfd's read lock), and a copy whose source a remove made stale
/// stops and goes on from a staging copy with the page zeroed.
#[test]
fn a_remove_during_a_blocks_copy_never_leaves_the_removed_page_filled() {
    need_uffd!();
    const SIZE: usize = 64 * MIB;
    let d = dir("remove-during-copy");
    let mem = memory_file(&d, SIZE, None);
    let socket = d.join("uffd.sock");
    let mut filled = Vec::new();
    for round in 0..4 {
        let srv = Running::start(
            &[(&socket, &mem)],
            one(ServerConfig {
                prefetch_threads: 0,
                handler_threads: 2,
                ..leave()
            }),
        );
        let mut vm = Standin::new(&[SIZE], true).unwrap();
        vm.connect(&socket).unwrap();
        // The VM's first remove, and a fault after it: from then on its copies and the
        // reads of its removes are kept apart (its first remove keeps the window).
        vm.remove(SIZE - PAGE, PAGE).unwrap();
        assert_eq!(vm.word(SIZE - 2 * PAGE), word((SIZE - 2 * PAGE) as u64));
        for b in 0..SIZE / MIB {
            let start = b * MIB;
            let at = start + 8 * PAGE;
            let go = std::sync::Barrier::new(2);
            std::thread::scope(|s| {
                s.spawn(|| {
                    go.wait();
                    vm.remove(start, PAGE).unwrap();
                });
                go.wait();
                assert_eq!(vm.word(at), word(at as u64));
            });
            if vm.word(start) != 0 {
                filled.push((round, start));
            }
        }
        vm.disconnect();
        let (r, log) = srv.join();
        r.unwrap();
        let _ = log;
    }
    assert!(
        filled.is_empty(),
        "removed pages filled with the snapshot's bytes at {filled:#x?}"
    );
}

#[test]
fn a_vm_is_served_firecrackers_handshake_every_page_and_its_balloons_removes() {
    need_uffd!();
    let d = dir("serve");
    let sizes = [24 * MIB, 8 * MIB];
    // The MiB at 20 MiB is a hole in the file: served as zero pages.
    let mem = memory_file(&d, 32 * MIB, Some(20 * MIB));
    let socket = d.join("uffd.sock");
    // Faults alone: the working set is what the VM touched.
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            prefetch_threads: 0,
            ..leave()
        }),
    );
    let mut vm = Standin::new(&sizes, true).unwrap();
    vm.connect(&socket).unwrap();
    // The balloon takes 64 KiB before anything was read there...
    let early = 3 * MIB + 5 * PAGE;
    vm.remove(early, 16 * PAGE).unwrap();
    vm.read_all(4);
    // ...and 8 KiB at the start of the second region after it was.
    let late = 24 * MIB + 7 * PAGE;
    vm.remove(late, 2 * PAGE).unwrap();
    for p in 0..32 * MIB / PAGE {
        for at in [p * PAGE, p * PAGE + 4088] {
            let removed =
                (early..early + 16 * PAGE).contains(&at) || (late..late + 2 * PAGE).contains(&at);
            let hole = (20 * MIB..21 * MIB).contains(&at);
            let want = if removed || hole { 0 } else { word(at as u64) };
            assert_eq!(vm.word(at), want, "{at:#x}: removed {removed}, hole {hole}");
        }
    }
    vm.disconnect();
    let (r, log) = srv.join();
    let last = r.unwrap().last.expect("its VM");
    assert!(matches!(last.end, SessionEnd::PeerClosed), "{log}");
    assert_eq!(last.engine.removes, 2, "{log}");
    // Every block came in for a fault, once each (a remove claims no block).
    assert_eq!(last.working_set.len(), 32);
    assert!(!socket.exists(), "the socket is removed");

    // Again, prefetching that working set first: the same contents.
    let cfg = one(ServerConfig {
        prefetch_threads: 2,
        ..leave()
    });
    let server = Server::new(
        vec![Socket {
            listener: Listener::bind(&socket).unwrap(),
            memory: MemoryFile::open(&mem).unwrap(),
            working_set: last.working_set.clone(),
        }],
        cfg,
    )
    .unwrap();
    let t = std::thread::spawn(move || server.run());
    let mut vm = Standin::new(&sizes, false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    vm.disconnect();
    let last = t.join().unwrap().unwrap().last.unwrap();
    assert_eq!(last.engine.prefetched_working_set, 32);
}

#[test]
fn a_vm_that_goes_mid_run_ends_its_session_cleanly() {
    need_uffd!();
    let d = dir("disconnect");
    let mem = memory_file(&d, 64 * MIB, None);
    let socket = d.join("uffd.sock");
    // Faults alone: what is in when the VM goes is what it read.
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            prefetch_threads: 0,
            handler_threads: 1,
            ..leave()
        }),
    );
    let mut vm = Standin::new(&[64 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    for p in 0..16 * MIB / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64));
    }
    vm.disconnect();
    let last = srv.join().0.unwrap().last.unwrap();
    assert!(matches!(last.end, SessionEnd::PeerClosed));
    assert_eq!(
        (last.engine.fault_blocks, last.engine.blocks),
        (16, 64),
        "{last:?}"
    );
    assert!(!socket.exists());
    vm.release().unwrap();
}

/// Every way a handshake goes wrong is refused with a typed error naming what is wrong; a
/// peer that sent no userfaultfd is dropped (it depends on nobody) and the server listens
/// on; one that did goes through the failure policy.
#[test]
fn bad_handshakes_are_refused_each_with_its_own_error() {
    need_uffd!();
    let d = dir("bad");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    type Send = Box<dyn Fn(&mut Standin, &Path)>;
    type Check = fn(&ServeError) -> bool;
    let cases: Vec<(&str, Vec<usize>, Send, Check)> = vec![
        (
            "garbage",
            vec![4 * MIB],
            Box::new(|vm, s| vm.send(s, b"\x00\x01 not json at all", true).unwrap()),
            |e| matches!(e, ServeError::Handshake(HandshakeError::NotRegions { .. })),
        ),
        (
            "no descriptor",
            vec![4 * MIB],
            Box::new(|vm, s| {
                let json = serde_json::to_vec(&vm.wire_regions()).unwrap();
                vm.send(s, &json, false).unwrap()
            }),
            |e| matches!(e, ServeError::Handshake(HandshakeError::NoVm(_))),
        ),
        (
            "not a userfaultfd",
            vec![4 * MIB],
            Box::new(|vm, s| {
                let json = serde_json::to_vec(&vm.wire_regions()).unwrap();
                let f = std::fs::File::open("/dev/null").unwrap();
                vm.send_other_fd(s, &json, &f).unwrap()
            }),
            |e| matches!(e, ServeError::Handshake(HandshakeError::NoVm(_))),
        ),
        (
            "too many regions",
            vec![4 * MIB],
            Box::new(|vm, s| {
                let many: Vec<String> = (0..40_000u64)
                    .map(|i| {
                        format!(
                            r#"{{"base_host_virt_addr":{},"size":4096,"offset":0}}"#,
                            (i + 1) << 13
                        )
                    })
                    .collect();
                vm.send(s, format!("[{}]", many.join(",")).as_bytes(), true)
                    .unwrap()
            }),
            |e| {
                matches!(
                    e,
                    ServeError::Handshake(HandshakeError::TooManyRegions(40_000))
                )
            },
        ),
        (
            "overlapping regions",
            vec![2 * MIB, 2 * MIB],
            Box::new(move |vm, s| {
                let a = vm.wire_regions()[0].base_host_virt_addr;
                let json = format!(
                    r#"[{{"base_host_virt_addr":{a},"size":2097152,"offset":0,"page_size":4096}},
                        {{"base_host_virt_addr":{},"size":2097152,"offset":2097152,"page_size":4096}}]"#,
                    a + 4096
                );
                vm.send(s, json.as_bytes(), true).unwrap()
            }),
            |e| matches!(e, ServeError::Handshake(HandshakeError::Overlap { .. })),
        ),
        (
            "disconnect mid-handshake",
            vec![4 * MIB],
            Box::new(|vm, s| {
                vm.send(s, br#"[{"base_host_virt_addr":1234"#, true)
                    .unwrap();
                vm.disconnect();
            }),
            |e| matches!(e, ServeError::Handshake(HandshakeError::Disconnected(_))),
        ),
        (
            "memory file shorter than the regions",
            vec![8 * MIB],
            Box::new(|vm, s| vm.connect(s).unwrap()),
            |e| {
                matches!(
                    e,
                    ServeError::MemoryFile {
                        problem: MemoryFileProblem::TooShort {
                            len: 0x40_0000,
                            region: 0,
                            ..
                        },
                        ..
                    }
                )
            },
        ),
    ];
    for (name, sizes, send, check) in cases {
        let srv = Running::start(
            &[(&socket, &mem)],
            ServerConfig {
                vms: Vms::One {
                    wait: Some(Duration::from_secs(5)),
                },
                ..leave()
            },
        );
        let mut vm = Standin::new(&sizes, false).unwrap();
        send(&mut vm, &socket);
        let (r, log) = srv.join();
        let e = r.expect_err(name);
        assert!(check(&e), "{name}: {e:?}\n{log}");
        if let ServeError::Handshake(HandshakeError::NoVm(_)) = e {
            // Not a VM: dropped while the server listened on for a real one.
            assert!(
                log.contains("dropped a connection that is not a VM's"),
                "{name}: {log}"
            );
        } else {
            // A VM that handed over its userfaultfd depends on the server: the refusal
            // goes through the failure policy, which says so.
            assert!(log.contains("left the peer"), "{name}: {log}");
        }
        assert!(!socket.exists(), "{name}: the socket file is left behind");
        // The VM's memory is untouched by the server: no page came in.
        vm.release().unwrap();
        assert_eq!(vm.word(0), 0, "{name}");
    }
}

/// A VM that cannot be served is ended through the pidfd taken when it connected: a
/// refusal after it sent its userfaultfd, a userfaultfd asking for fork events, garbage.
/// With the policy `Leave` it is left, and the log says so.
#[test]
fn a_vm_that_cannot_be_served_is_killed_through_its_pidfd() {
    need_uffd!();
    let d = dir("kill");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let fork = u64::from(linux_raw_sys::general::UFFD_FEATURE_EVENT_FORK);
    for (name, size, features, does) in [
        ("shorter file", 8 * MIB, 0, ChildDoes::Handshake),
        ("fork events", 4 * MIB, fork, ChildDoes::Handshake),
        ("garbage", 4 * MIB, 0, ChildDoes::Garbage),
    ] {
        for on_failure in [OnFailure::Kill, OnFailure::Leave] {
            let srv = Running::start(
                &[(&socket, &mem)],
                one(ServerConfig {
                    on_failure,
                    ..ServerConfig::default()
                }),
            );
            let mut vm = vm_child(&socket, size, features, does, &go);
            let (r, log) = srv.join();
            assert!(r.is_err(), "{name}: {log}");
            if on_failure == OnFailure::Leave {
                assert!(log.contains(&format!("left the peer {}", vm.id())), "{log}");
                std::thread::sleep(Duration::from_millis(100));
                assert!(vm.running(), "{name}: a VM left is not killed");
            } else {
                let killed = format!("killed the peer {} (through its pidfd)", vm.id());
                assert!(log.contains(&killed), "{name}: {log}");
                let st = vm.wait_exit(10);
                assert_eq!(st.signal(), Some(libc::SIGKILL), "{name}: {st:?}");
            }
        }
    }
}

/// A one-VM server of a 4 MiB file that prefetches nothing (every page the VM reads is a
/// fault), and a VM in a child process that does `does`, once the server has taken its
/// hang-up for a VM running on (the go file not written yet); the go file's path, and its
/// folder (removed when dropped).
fn hung_up(name: &str, does: ChildDoes) -> (Running, ChildGuard, PathBuf, Scratch) {
    let d = dir(name);
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            prefetch_threads: 0,
            ..ServerConfig::default()
        }),
    );
    let mut vm = vm_child(&socket, 4 * MIB, 0, does, &go);
    let t = Instant::now();
    while !srv.logged().contains("still holds its userfaultfd") {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the hang-up was not taken for a VM running on: {}",
            srv.logged()
        );
        assert!(vm.running(), "the VM went: {}", srv.logged());
        std::thread::sleep(Duration::from_millis(5));
    }
    (srv, vm, go, d)
}

/// A VM that closes its socket but runs on, holding its userfaultfd, is served until its
/// process exits: its faults after the hang-up are answered, every word right, and its
/// session ends with the process. (Before, its session ended with the socket, and its
/// next fault waited forever.)
#[test]
fn a_vm_that_hangs_up_and_runs_on_is_served_until_it_exits() {
    need_uffd!();
    served_until_it_exits("hang-up", ChildDoes::HangUpAndRunOn);
}

/// The same when the VM's main thread has exited before it hung up, its other threads
/// running on: its process's `stat` says zombie, and the descriptors are found through a
/// live thread. (Before, the main thread alone was looked at: the VM was taken as gone and
/// its faults after the hang-up waited forever.)
#[test]
fn a_vm_whose_main_thread_exited_is_served_while_its_other_threads_run() {
    need_uffd!();
    served_until_it_exits("main-gone", ChildDoes::MainThreadExitsHangsUpAndRunsOn);
}

/// A VM in a child that `does` a hang-up and runs on: told to, it reads all its memory,
/// each word checked, and exits 0; its session ends with its process, every page it read
/// faulted in (nothing prefetched).
fn served_until_it_exits(name: &str, does: ChildDoes) {
    let (srv, mut vm, go, _d) = hung_up(name, does);
    std::fs::write(&go, b"").unwrap();
    let st = vm.wait_exit(30);
    assert_eq!(st.code(), Some(0), "{st:?}: {}", srv.logged());
    let (r, log) = srv.join();
    let last = r.unwrap().last.expect("its VM");
    assert!(matches!(last.end, SessionEnd::PeerExited), "{log}");
    assert!(last.engine.faults > 0, "{log}");
    assert_eq!(last.engine.prefetched_blocks, 0, "{log}");
}

/// A take-over that is never confirmed gives nothing away: the new server received the
/// old one's socket and VM, could not confirm (and cannot on a second try), and stopped
/// (dropped what it had) before it said `taken`. The
/// old server serves the VM on at once, every word right, and says why; nothing is ended.
/// (Before, the hand-off had no acknowledgement: the VM would have been ended.)
#[test]
fn a_take_over_dropped_before_it_is_confirmed_gives_nothing_away() {
    need_uffd!();
    const SIZE: usize = 8 * MIB;
    let (_d, socket, srv, control, _control) = faults_only_with_control("take-over-dropped", SIZE);
    let mut vm = Standin::new(&[SIZE], false).unwrap();
    vm.connect(&socket).unwrap();
    for p in 0..SIZE / 2 / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64));
    }
    let mut taken = guestmem::serve::take_over(&control, Duration::from_secs(10)).unwrap();
    assert_eq!(taken.vms(), 1);
    assert!(!taken.confirmed());
    // Its socket was not taken (no `listener` asked for it): refused, and refused again.
    for _ in 0..2 {
        let e = taken
            .confirm(&[], None, Duration::from_secs(10))
            .unwrap_err();
        assert!(
            e.to_string().contains("the old server serves its VMs on"),
            "{e}"
        );
        assert!(!taken.confirmed());
    }
    drop(taken);
    for p in SIZE / 2 / PAGE..SIZE / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64), "page {p}");
    }
    assert!(socket.exists(), "the socket path stays");
    vm.disconnect();
    let (r, log) = srv.drain();
    let r = r.unwrap();
    assert!(
        log.contains("the new server did not take the hand-off (it closed the connection")
            && !log.contains("handed"),
        "{log}"
    );
    // It hung up; the drain may come first.
    assert!(
        matches!(
            r.last.expect("its VM").end,
            SessionEnd::PeerClosed | SessionEnd::Graduated
        ),
        "{log}"
    );
}

/// A new server that asks for the hand-off and then reads nothing (stopped, in a
/// debugger) holds nothing up past the send's limit: its VM's record is larger than the
/// socket's buffer (4,096 regions), so the send waits; it fails after 10 s, and the old
/// server serves the VM on, every word right, and drains when told. Before, the old
/// server's supervisor waited on that send for ever, the VM unserved.
#[test]
fn a_new_server_that_stops_reading_mid_hand_off_holds_nothing_up() {
    use std::io::Write;
    need_uffd!();
    // A whole number of MiB: the memory file is made a MiB at a time.
    const REGIONS: usize = 4096;
    let (_d, socket, srv, control, _control) =
        faults_only_with_control("take-over-stalled", REGIONS * PAGE);
    let mut vm = Standin::new(&[PAGE; REGIONS], false).unwrap();
    vm.connect(&socket).unwrap();
    for p in 0..REGIONS / 2 {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64));
    }
    let mut stalled = std::os::unix::net::UnixStream::connect(&control).unwrap();
    stalled
        .write_all(b"handoff acknowledged removed\n")
        .unwrap();
    // The rest of the VM's pages, on a thread: a VM the server no longer serves would
    // wait on its faults for ever.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let bad: Vec<usize> = (REGIONS / 2..REGIONS)
            .filter(|p| vm.word(p * PAGE) != word((p * PAGE) as u64))
            .collect();
        let _ = tx.send((vm, bad));
    });
    let (mut vm, bad) = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the VM's faults went unserved past the hand-off's send limit");
    assert!(bad.is_empty(), "pages {bad:?}");
    vm.disconnect();
    let (r, log) = srv.drain();
    r.unwrap();
    assert!(
        log.contains("the new server did not take the hand-off"),
        "{log}"
    );
    drop(stalled);
}

/// A command the control socket does not know is answered in JSON whatever it holds
/// (quotes, control characters): before, the command was quoted as Rust quotes it, which
/// is no JSON once it held either.
#[test]
fn an_unknown_command_is_answered_in_json() {
    use std::io::{Read, Write};
    need_uffd!();
    let d = dir("unknown-command");
    let mem = memory_file(&d, MIB, None);
    let socket = d.join("uffd.sock");
    let srv = Running::start(&[(&socket, &mem)], leave());
    let (control, _control) = srv.control(&d.join("ctl.sock"));
    let mut c = std::os::unix::net::UnixStream::connect(&control).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"st\x01a\"tus\n").unwrap();
    let mut reply = String::new();
    c.read_to_string(&mut reply).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(reply.trim()).unwrap_or_else(|e| panic!("{e}: {reply}"));
    let e = v["error"].as_str().unwrap();
    assert!(
        e.starts_with("unknown command \"st\\u0001a\\\"tus\""),
        "{e}"
    );
    let (r, log) = srv.drain();
    r.unwrap_or_else(|e| panic!("{e}: {log}"));
}

/// A new server of an earlier version sends `handoff` and no acknowledgement: it is
/// handed everything at once, its end mark as that version's was, byte for byte, and the
/// old server returns with the VM handed off.
#[test]
fn a_new_server_of_an_earlier_version_is_handed_everything_at_once() {
    use std::io::{Read, Write};
    need_uffd!();
    let d = dir("take-over-earlier");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    // With a state directory: the end mark names none to an earlier version.
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            state_dir: Some(d.join("state")),
            ..leave()
        },
    );
    let (control, _control) = srv.control(&d.join("ctl.sock"));
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    let mut new = std::os::unix::net::UnixStream::connect(&control).unwrap();
    new.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    new.write_all(b"handoff\n").unwrap();
    // Descriptors that come with the messages are closed as they are read.
    let mut text = String::new();
    new.read_to_string(&mut text).unwrap();
    let (r, log) = srv.join();
    assert!(
        text.contains("\"kind\":\"listener\"")
            && text.contains("\"kind\":\"session\"")
            && text.trim_end().ends_with("{\"kind\":\"end\"}"),
        "{text}"
    );
    let r = r.unwrap();
    assert!(
        matches!(r.last.expect("its VM").end, SessionEnd::HandedOff),
        "{log}"
    );
    assert!(log.contains("handed 1 sockets and 1 VMs"), "{log}");
    vm.disconnect();
}

/// A new server of the version before removed pages went with a VM (it sends `handoff
/// acknowledged`) is sent none, though the VM removed some: each VM's message carries its
/// userfaultfd alone, as that version reads them (a second descriptor would be taken for
/// the next VM's). Told anything but `taken`, the old server serves on, the removed pages
/// still zeros.
#[test]
fn a_new_server_of_the_version_before_is_sent_no_removed_pages() {
    use std::io::{BufRead, BufReader, Write};
    need_uffd!();
    let (_d, socket, srv, control, _control) =
        faults_only_with_control("take-over-before-removed", 4 * MIB);
    let mut vm = Standin::new(&[4 * MIB], true).unwrap();
    vm.connect(&socket).unwrap();
    vm.remove(MIB, 4 * PAGE).unwrap();
    let mut new = std::os::unix::net::UnixStream::connect(&control).unwrap();
    new.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    new.write_all(b"handoff acknowledged\n").unwrap();
    let mut lines = Vec::new();
    let mut r = BufReader::new(&new);
    loop {
        let mut line = String::new();
        assert!(r.read_line(&mut line).unwrap() > 0, "{lines:?}");
        let end = line.starts_with("{\"kind\":\"end\"");
        lines.push(line);
        if end {
            break;
        }
    }
    assert!(
        lines.iter().any(|l| l.contains("\"kind\":\"session\""))
            && !lines.iter().any(|l| l.contains("\"removed\"")),
        "{lines:?}"
    );
    (&new).write_all(b"not taken\n").unwrap();
    drop(r);
    drop(new);
    for at in [MIB, MIB + 3 * PAGE + 8] {
        assert_eq!(vm.word(at), 0, "{at:#x}: removed");
    }
    assert_eq!(vm.word(2 * MIB), word(2 * MIB as u64));
    vm.disconnect();
    let (r, log) = srv.drain();
    r.unwrap();
    assert!(
        log.contains("the new server did not take the hand-off"),
        "{log}"
    );
}

/// A VM that hung up, runs on, and then unmaps its memory has let go of it: when the
/// server next fills a page there (here the drain's graduation) and finds no memory, the
/// session ends as the VM's hang-up, the VM is not killed, and the drain does not wait.
/// (A fill finding no memory under a VM still connected is a failure, as before.)
#[test]
fn a_vm_that_hung_up_and_unmapped_its_memory_has_let_go_of_it() {
    need_uffd!();
    let (srv, mut vm, go, _d) = hung_up("let-go", ChildDoes::HangUpUnmapAndRunOn);
    std::fs::write(&go, b"").unwrap();
    let mut unmapped = go.clone().into_os_string();
    unmapped.push(".unmapped");
    let t = Instant::now();
    while !Path::new(&unmapped).exists() {
        assert!(t.elapsed() < Duration::from_secs(40), "{}", srv.logged());
        std::thread::sleep(Duration::from_millis(5));
    }
    let (r, log) = srv.drain();
    let last = r.unwrap().last.expect("its VM");
    assert!(matches!(last.end, SessionEnd::PeerClosed), "{log}");
    assert!(vm.running(), "the VM was ended: {log}");
}

/// A connection that says nothing is dropped after the handshake timeout while the server
/// listens on, and one still pending does not hold up the real VM behind it; once a one-VM
/// server has its VM it stops listening.
#[test]
fn squatters_hold_nobody_up_and_a_one_vm_server_stops_listening() {
    need_uffd!();
    let d = dir("squat");
    let mem = memory_file(&d, 8 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            handshake_timeout: Duration::from_secs(1),
            ..leave()
        }),
    );
    let early = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let squatter = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    let mut vm = Standin::new(&[8 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // The socket goes once the VM is taken, which a busy supervisor may come to after the
    // VM's first faults are served.
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_ok() {
        assert!(t.elapsed() < Duration::from_secs(10), "still listening");
        std::thread::sleep(Duration::from_millis(5));
    }
    vm.disconnect();
    let (r, log) = srv.join();
    assert!(r.is_ok(), "{log}");
    assert!(
        log.contains("dropped a connection that is not a VM's")
            && log.contains("nothing received within 1.0 s"),
        "{log}"
    );
    drop((early, squatter));
}

/// Sixteen connections that send nothing no longer keep a VM waiting until their
/// handshake timeout (two minutes here): once one has been silent for a second, the VM's
/// connection takes its place. (Before, the VM waited in the backlog until a squatter's
/// timeout ran out.)
#[test]
fn silent_connections_make_room_for_a_vm() {
    need_uffd!();
    let d = dir("silent");
    let mem = memory_file(&d, 8 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            handshake_timeout: Duration::from_secs(120),
            ..leave()
        },
    );
    let squatters: Vec<_> = (0..16)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket).unwrap())
        .collect();
    let mut vm = Standin::new(&[8 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    let t = Instant::now();
    while srv.status.snapshot().sessions.len() != 1 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the VM waited behind the silent connections: {}",
            srv.logged()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    assert!(
        srv.logged().contains("dropped a connection silent for"),
        "{}",
        srv.logged()
    );
    // The one dropped reads the end of its stream; the others are still pending.
    let ended = squatters
        .iter()
        .filter(|s| {
            s.set_nonblocking(true).unwrap();
            matches!(std::io::Read::read(&mut &**s, &mut [0u8; 1]), Ok(0))
        })
        .count();
    assert_eq!(ended, 1);
    vm.disconnect();
    drop(squatters);
    let (r, log) = srv.drain();
    assert!(r.is_ok(), "{log}");
}

/// A one-VM server with two VMs at its door serves one and ends the other through its
/// pidfd: neither is left waiting on a server that will never serve it.
#[test]
fn a_second_vm_at_a_one_vm_server_is_ended_not_left_hung() {
    need_uffd!();
    let d = dir("two-vms");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let srv = Running::start(&[(&socket, &mem)], one(ServerConfig::default()));
    let mut a = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
    let mut b = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
    std::fs::write(&go, b"").unwrap();
    let t = Instant::now();
    let a_ended = loop {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "neither VM was ended"
        );
        if !a.running() {
            break true;
        }
        if !b.running() {
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (dead, alive) = if a_ended {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    // Killed through its pidfd if its handshake reached the server, or refused at
    // connect if it came after the server stopped listening.
    let st = dead.wait_exit(5);
    let killed = st.signal() == Some(libc::SIGKILL);
    assert!(killed || st.code() == Some(CHILD_REFUSED), "{st:?}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive.running(), "the VM being served is left alone");
    drop(std::mem::replace(alive, ChildGuard::none()));
    let (r, log) = srv.join();
    let r = r.unwrap_or_else(|e| panic!("{e}: {log}"));
    if killed {
        assert!(log.contains("serves one VM and has it"), "{log}");
        // Counted and logged as refused, as a VM refused at admission is (it was not
        // before 2026-11-29).
        assert_eq!(r.status.refused, 1, "{log}");
        assert!(log.contains("refused:"), "{log}");
    }
}

/// The handshake timeout is for the whole handshake: a peer that trickles its JSON a byte
/// at a time is cut off when it runs out.
#[test]
fn a_trickling_handshake_is_cut_off_at_its_deadline() {
    need_uffd!();
    let d = dir("trickle");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            handshake_timeout: Duration::from_secs(1),
            ..leave()
        }),
    );
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.send(&socket, b"[", true).unwrap();
    let s = vm.socket_clone().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickler = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            let t = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && t.elapsed() < Duration::from_secs(10)
                && (&s).write_all(b" ").is_ok()
            {
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let t = Instant::now();
    let (r, log) = srv.join();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickler.join().unwrap();
    match r {
        Err(ServeError::Handshake(HandshakeError::CutOff { timeout, .. })) => {
            assert_eq!(timeout, Duration::from_secs(1))
        }
        other => panic!("{other:?}\n{log}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "cut off at its deadline"
    );
    vm.release().unwrap();
}

/// One server, two snapshots, twenty VMs at once on one pool; drained, every VM graduates:
/// every page is in and nothing is registered any more.
#[test]
fn one_server_serves_twenty_vms_of_two_snapshots_and_graduates_them_at_a_drain() {
    need_uffd!();
    const VMS: usize = 20;
    const SIZE: usize = 16 * MIB;
    let d = dir("many");
    let (a_dir, b_dir) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    // The second snapshot has a hole at 5 MiB: a VM served from the wrong file reads the
    // wrong bytes there.
    let mem_a = memory_file(&a_dir, SIZE, None);
    let mem_b = memory_file(&b_dir, SIZE, Some(5 * MIB));
    let (sock_a, sock_b) = (d.join("a.sock"), d.join("b.sock"));
    let srv = Running::start(&[(&sock_a, &mem_a), (&sock_b, &mem_b)], leave());
    let want = |vm: usize, at: usize| {
        if vm % 2 == 1 && (5 * MIB..6 * MIB).contains(&at) {
            0
        } else {
            word(at as u64)
        }
    };
    let mut vms: Vec<Standin> = (0..VMS)
        .map(|_| Standin::new(&[SIZE], false).unwrap())
        .collect();
    for (i, vm) in vms.iter_mut().enumerate() {
        vm.connect(if i % 2 == 0 { &sock_a } else { &sock_b })
            .unwrap();
    }
    std::thread::scope(|s| {
        for (i, vm) in vms.iter().enumerate() {
            s.spawn(move || {
                for p in 0..SIZE / 2 / PAGE {
                    let at = p * PAGE;
                    assert_eq!(vm.word(at), want(i, at), "VM {i}, page at {at:#x}");
                    assert_eq!(vm.word(at + 4088), want(i, at + 4088), "VM {i}");
                }
            });
        }
    });
    let (r, log) = srv.drain();
    let st = r.unwrap().status;
    let graduated: u64 = st.sockets.iter().map(|k| k.ended.graduated).sum();
    assert_eq!(graduated, VMS as u64, "{log}");
    assert_eq!(st.sockets[0].sessions, (VMS / 2) as u64);
    assert!(!sock_a.exists() && !sock_b.exists(), "sockets removed");
    // With the server gone every page is there: nothing reads zero in its place, and no
    // read waits (the ranges are unregistered).
    for (i, vm) in vms.iter().enumerate() {
        for p in 0..SIZE / PAGE {
            let at = p * PAGE;
            assert_eq!(vm.word(at), want(i, at), "VM {i}, page at {at:#x}");
        }
    }
}

/// A server ends only the VM it cannot serve, refuses a VM past its limit (ending it), and
/// drops a connection that sends nothing; the others go on.
#[test]
fn a_server_ends_only_the_vm_it_cannot_serve_and_refuses_past_its_limit() {
    need_uffd!();
    let d = dir("limits");
    let mem = memory_file(&d, 8 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            max_vms: 2,
            handler_threads: 2,
            ..ServerConfig::default()
        },
    );
    let mut a = Standin::new(&[8 * MIB], false).unwrap();
    a.connect(&socket).unwrap();
    assert_eq!(a.word(0), word(0));
    // A VM whose regions do not fit the memory file: ended through its pidfd.
    let mut big = vm_child(&socket, 16 * MIB, 0, ChildDoes::Handshake, &go);
    assert_eq!(big.wait_exit(10).signal(), Some(libc::SIGKILL));
    let _idle = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    let mut c = Standin::new(&[8 * MIB], false).unwrap();
    c.connect(&socket).unwrap();
    assert_eq!(c.word(0), word(0));
    // A third is past the limit of 2: refused and ended.
    let mut third = vm_child(&socket, 8 * MIB, 0, ChildDoes::Handshake, &go);
    assert_eq!(third.wait_exit(10).signal(), Some(libc::SIGKILL));
    assert_eq!(a.compare(&mem).unwrap(), Ok(()));
    assert_eq!(c.compare(&mem).unwrap(), Ok(()));
    c.disconnect();
    let t = Instant::now();
    while srv.status.snapshot().sessions.len() != 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "the session went on");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (r, log) = srv.drain();
    let st = r.unwrap().status;
    assert!(log.contains("holds 0x800000 bytes, but region 0"), "{log}");
    assert!(
        log.contains("refused at a limit: VMs served at once: 2 in use"),
        "{log}"
    );
    assert_eq!(st.refused, 2, "{log}");
    let e = st.sockets[0].ended;
    assert_eq!((e.peer_closed, e.graduated), (1, 1), "{log}");
}

/// Prefetch threads bring every VM's memory in from its handshake on, shared by all the
/// VMs: memory no vCPU touched comes in.
#[test]
fn every_vm_is_prefetched_from_its_handshake_on_by_shared_threads() {
    need_uffd!();
    const SIZE: usize = 8 * MIB;
    let d = dir("prefetch");
    let mem = memory_file(&d, SIZE, Some(3 * MIB));
    let socket = d.join("uffd.sock");
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            handler_threads: 1,
            prefetch_threads: 1,
            ..leave()
        },
    );
    let mut vms: Vec<Standin> = (0..4)
        .map(|_| Standin::new(&[SIZE], false).unwrap())
        .collect();
    for vm in &mut vms {
        vm.connect(&socket).unwrap();
    }
    // Nothing is read; every page comes in anyway (the hole's as the shared zero page,
    // which Rss does not count).
    let t = Instant::now();
    for vm in &vms {
        while vm.resident().unwrap() < (SIZE - MIB) as u64 {
            assert!(t.elapsed() < Duration::from_secs(20), "not prefetched");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    for vm in &mut vms {
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
        vm.disconnect();
    }
    // Every hang-up seen before the drain (one not yet seen is ended as graduated).
    let t = Instant::now();
    while !srv.status.snapshot().sessions.is_empty() {
        assert!(t.elapsed() < Duration::from_secs(10), "a session went on");
        std::thread::sleep(Duration::from_millis(5));
    }
    let st = srv.drain().0.unwrap().status;
    assert_eq!(st.sockets[0].faults, 0, "prefetched, never faulted");
    assert_eq!(st.sockets[0].ended.peer_closed, 4);
}

/// A server's prefetch held (as a move holds it until the VM runs): nothing comes in but
/// what is faulted, and faults are served, until the hold is dropped; then every page
/// comes in.
#[test]
fn a_held_prefetch_brings_in_only_what_is_faulted_until_let_go() {
    need_uffd!();
    const SIZE: usize = 8 * MIB;
    let d = dir("prefetch-held");
    let mem = memory_file(&d, SIZE, Some(3 * MIB));
    let socket = d.join("uffd.sock");
    let (srv, hold) = Running::start_with(
        &[(&socket, &mem)],
        ServerConfig {
            handler_threads: 1,
            prefetch_threads: 2,
            ..leave()
        },
        Server::hold_prefetch,
    );
    let mut vm = Standin::new(&[SIZE], false).unwrap();
    vm.connect(&socket).unwrap();
    let at = 5 * MIB + 3 * PAGE;
    assert_eq!(vm.word(at), word(at as u64));
    // Held: a while later, still only the faulted block is in.
    std::thread::sleep(Duration::from_millis(300));
    let held = vm.resident().unwrap();
    assert!(
        held <= MIB as u64,
        "{held} bytes in while prefetch was held"
    );
    drop(hold);
    // Every block in, the hole's too (Rss does not count its zero page: a block another
    // prefetch thread took and has not yet installed would be faulted by the compare).
    let t = Instant::now();
    while srv.status.snapshot().sessions[0]
        .engine
        .complete_secs
        .is_none()
    {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "not prefetched once let go"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(vm.resident().unwrap() >= (SIZE - MIB) as u64);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // The one fault read its block: kept as measured too, within its histogram bucket.
    let engine = srv.status.snapshot().sessions[0].engine.clone();
    let (exact, file) = (&engine.file_fault_exact, &engine.fault_latency.file);
    assert_eq!((exact.count, file.count), (1, 1), "{engine:?}");
    assert!(exact.p50_us > 0.0 && exact.p99_us == exact.p50_us && exact.max_us == exact.p50_us);
    // A bucket spans at most a quarter of its lower bound (4 steps an octave; the first
    // step of each octave is the widest, 1.25x).
    assert!(
        exact.p50_us <= file.p50_us && exact.p50_us * 1.25 >= file.p50_us,
        "{engine:?}"
    );
    vm.disconnect();
    let st = srv.drain().0.unwrap().status;
    assert_eq!(st.sockets[0].faults, 1, "the one word read");
}

/// A working set learnt from one clone (the blocks it faulted, first fault first) is kept
/// beside the memory file and prefetched first for the next clone, by a later server too.
#[test]
fn a_working_set_learnt_from_one_clone_is_prefetched_for_the_next() {
    need_uffd!();
    let d = dir("learn");
    let mem = memory_file(&d, 16 * MIB, None);
    let socket = d.join("uffd.sock");
    let learnt = d.join("memory.guestmem-ws.json");
    // Learnt from faults: no prefetch to get there first.
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            learn_working_sets: true,
            prefetch_threads: 0,
            ..leave()
        },
    );
    let touch = |vm: &Standin| {
        for m in (8..16).rev() {
            assert_eq!(vm.word(m * MIB), word((m * MIB) as u64));
        }
    };
    let mut first = Standin::new(&[16 * MIB], false).unwrap();
    first.connect(&socket).unwrap();
    touch(&first);
    first.disconnect();
    let t = Instant::now();
    while !learnt.exists() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "no learnt working set"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = srv.drain();
    let ws: serde_json::Value = serde_json::from_slice(&std::fs::read(&learnt).unwrap()).unwrap();
    let offsets: Vec<u64> = ws["offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(
        offsets,
        (8..16).rev().map(|m| (m * MIB) as u64).collect::<Vec<_>>(),
        "first touch first: {ws}"
    );
    // A later server, prefetching: the next clone gets those blocks first.
    let srv = Running::start(
        &[(&socket, &mem)],
        ServerConfig {
            learn_working_sets: true,
            prefetch_threads: 1,
            ..leave()
        },
    );
    let mut next = Standin::new(&[16 * MIB], false).unwrap();
    next.connect(&socket).unwrap();
    let t = Instant::now();
    loop {
        let st = srv.status.snapshot();
        if let [s] = &st.sessions[..] {
            if s.engine.prefetched_blocks >= 8 {
                assert_eq!(s.engine.prefetched_working_set, 8);
                break;
            }
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no prefetch: {st:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    touch(&next);
    assert_eq!(
        srv.status.snapshot().sessions[0].engine.fault_blocks,
        0,
        "none of the blocks the first clone faulted was faulted again"
    );
    assert_eq!(next.compare(&mem).unwrap(), Ok(()));
    next.disconnect();
    let _ = srv.drain();
}

/// A memory file written in place while served ends its VMs (they would be served a mix of
/// two files) and closes its socket; the other snapshot's VMs are untouched.
#[test]
fn a_memory_file_written_while_served_ends_its_vms_and_closes_its_socket() {
    need_uffd!();
    let d = dir("changed");
    let (a_dir, b_dir) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    let mem_a = memory_file(&a_dir, 8 * MIB, None);
    let mem_b = memory_file(&b_dir, 8 * MIB, None);
    let (sock_a, sock_b) = (d.join("a.sock"), d.join("b.sock"));
    let srv = Running::start(&[(&sock_a, &mem_a), (&sock_b, &mem_b)], leave());
    let mut a = Standin::new(&[8 * MIB], false).unwrap();
    a.connect(&sock_a).unwrap();
    let mut b = Standin::new(&[8 * MIB], false).unwrap();
    b.connect(&sock_b).unwrap();
    assert_eq!(a.word(0), word(0));
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&mem_a)
            .unwrap();
        f.write_all_at(&[0xff; 8], (4 * MIB) as u64).unwrap();
    }
    let t = Instant::now();
    while sock_a.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "socket A still open");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.compare(&mem_b).unwrap(), Ok(()));
    assert!(std::os::unix::net::UnixStream::connect(&sock_a).is_err());
    let log = srv.logged();
    let (r, _) = srv.drain();
    let st = r.unwrap().status;
    assert!(log.contains("changed while served"), "{log}");
    assert_eq!(st.sockets[0].ended.failed, 1, "{log}");
    assert_eq!(st.sockets[1].ended.graduated, 1, "{log}");
    a.release().unwrap();
}

/// Once a VM's memory is all in, the server collapses it to huge pages in the VM's process
/// (`REGAIN_SETTLE` later); `regain_huge: false` leaves it on 4 KiB pages. (That the
/// server waits for a collapse its VM's going stopped is tested through the CLI, whose log
/// shows the collapse's end.)
#[test]
fn a_served_vm_gets_huge_pages_back_once_all_its_memory_is_in() {
    need_uffd!();
    const SIZE: usize = 16 * MIB;
    let d = dir("regain");
    let mem = memory_file(&d, SIZE, None);
    for regain_huge in [true, false] {
        let socket = d.join(format!("uffd-{regain_huge}.sock"));
        let srv = Running::start(
            &[(&socket, &mem)],
            one(ServerConfig {
                regain_huge,
                // Faults alone: all memory is in only once the last page is read.
                prefetch_threads: 0,
                ..leave()
            }),
        );
        let mut vm = Standin::new(&[SIZE], false).unwrap();
        vm.connect(&socket).unwrap();
        // Every page but the last: not all in yet, so no collapse has started (it starts
        // REGAIN_SETTLE after the last block comes in, which a held-up test may pass).
        for p in 0..SIZE / PAGE - 1 {
            vm.word(p * PAGE);
        }
        assert_eq!(vm.anon_huge().unwrap(), 0, "UFFDIO_COPY fills 4 KiB pages");
        vm.read_all(2);
        let t = Instant::now();
        // At least 6 whole 2 MiB chunks lie in 16 MiB, however it is aligned.
        while regain_huge && vm.anon_huge().unwrap() < 6 * 2 * MIB as u64 {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no huge pages came back"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
        vm.disconnect();
        let (r, log) = srv.join();
        assert!(r.is_ok(), "{log}");
        if !regain_huge {
            assert_eq!(vm.anon_huge().unwrap(), 0, "off: left on 4 KiB pages");
        }
    }
}

/// 2 MiB hugetlb guests are served a whole huge page per fault; a base or offset off a
/// 2 MiB boundary, or a page size that is neither 4 KiB nor 2 MiB, is refused naming the
/// JSON field at fault.
#[test]
fn two_mib_guests_are_served_a_huge_page_per_fault_and_bad_ones_refused_by_field() {
    need_uffd!();
    const SIZE: usize = 32 * MIB;
    let _host = guestmem_testkit::host_lock();
    // The stand-in's memory (16 pages) and a stand-in for each refusal below (1 page each,
    // never touched: reserved at mmap).
    let pool = match guestmem_testkit::HugePool2M::grow(16 + 3) {
        Ok(p) => p,
        Err(why) => return guestmem_testkit::skip(why),
    };
    let d = dir("huge");
    let mem = memory_file(&d, SIZE, Some(6 * MIB));
    let socket = d.join("uffd.sock");
    // Faults alone: one per 2 MiB page touched; 1 MiB blocks are raised to the page.
    let srv = Running::start(
        &[(&socket, &mem)],
        one(ServerConfig {
            prefetch_threads: 0,
            block_bytes: 1 << 20,
            ..leave()
        }),
    );
    let mut vm = Standin::huge(&[SIZE], 2 * MIB).unwrap();
    assert_eq!(vm.wire_regions()[0].page_size, 2 * MIB);
    vm.connect(&socket).unwrap();
    // One reader: each 2 MiB page faults once and comes in whole.
    vm.read_all(1);
    assert_eq!(
        vm.compare(&mem).unwrap(),
        Ok(()),
        "every qword as the file has it"
    );
    vm.disconnect();
    let last = srv.join().0.unwrap().last.unwrap();
    assert_eq!(
        (
            last.engine.faults,
            last.engine.fault_blocks,
            last.engine.zero_blocks
        ),
        (16, 16, 0),
        "one fault per 2 MiB page: {last:?}"
    );
    drop(vm);
    type Edit = fn(&mut serde_json::Value);
    let edits: [(&str, Edit); 3] = [
        ("base_host_virt_addr", |r| {
            r["base_host_virt_addr"] = (r["base_host_virt_addr"].as_u64().unwrap() + 4096).into()
        }),
        ("offset", |r| r["offset"] = 4096.into()),
        ("page_size", |r| {
            r["page_size"] = 8192.into();
            r["page_size_kib"] = 8192.into();
        }),
    ];
    for (field, edit) in edits {
        let srv = Running::start(&[(&socket, &mem)], one(leave()));
        let mut bad = Standin::huge(&[2 * MIB], 2 * MIB).unwrap();
        let mut regions = serde_json::to_value(bad.wire_regions()).unwrap();
        edit(&mut regions[0]);
        bad.send(&socket, regions.to_string().as_bytes(), true)
            .unwrap();
        match srv.join().0 {
            Err(ServeError::Handshake(e)) => assert_eq!(e.field(), Some(field), "{e}"),
            other => panic!("{field}: {other:?}"),
        }
    }
    drop(pool);
}
