//! `guestmem serve-uffd` against a Firecracker stand-in (guestmem_lab::fc_standin): the
//! handshake exactly as Firecracker sends it, several threads touching every page, contents
//! equal to the memory file, a balloon's removes, disconnects, and every bad handshake.

use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guestmem_lab::fc_standin::{Standin, PAGE};
use guestmem_testkit::{ChildGuard as Guard, Scratch};

const MIB: usize = 1 << 20;

/// Why this machine cannot run these tests, if it cannot.
fn missing() -> Option<String> {
    // SAFETY: flags only; the descriptor is closed at once.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        return Some(format!(
            "userfaultfd unavailable ({}): needs root or vm.unprivileged_userfaultfd",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(fd as i32) };
    None
}

macro_rules! need_uffd {
    () => {
        if let Some(why) = missing() {
            guestmem_testkit::skip(format_args!("{why}"));
            return;
        }
    };
}

/// A fresh folder for one test, removed when dropped (a failing test leaves nothing either).
fn dir(name: &str) -> Scratch {
    Scratch::new(&format!("serve-{name}"))
}

/// The word at byte `at` of the test memory file: a mix of the offset, never zero.
fn word(at: u64) -> u64 {
    let mut x = at.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xdead_beef;
    x ^= x >> 29;
    x | 1
}

/// A memory file of `size` bytes; the MiB at `hole` (if any) is left a hole (zero).
fn mem_file(d: &Path, size: usize, hole: Option<usize>) -> PathBuf {
    let p = d.join("memory");
    let mut f = std::fs::File::create(&p).unwrap();
    let mut buf = vec![0u8; MIB];
    for m in 0..size / MIB {
        if Some(m * MIB) == hole {
            f.set_len(((m + 1) * MIB) as u64).unwrap();
            std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(((m + 1) * MIB) as u64)).unwrap();
            continue;
        }
        for (k, c) in buf.chunks_exact_mut(8).enumerate() {
            c.copy_from_slice(&word((m * MIB + k * 8) as u64).to_ne_bytes());
        }
        f.write_all(&buf).unwrap();
    }
    f.set_len(size as u64).unwrap();
    p
}

/// Starts `guestmem serve-uffd --once` without waiting for its socket. `GUESTMEM_BIN` names
/// another build to test instead (an A/B of two commits).
fn spawn_server(socket: &Path, mem: &Path, extra: &[&str]) -> Guard {
    let bin =
        std::env::var_os("GUESTMEM_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_guestmem").into());
    Guard::new(
        Command::new(bin)
            .arg("serve-uffd")
            .arg("--once")
            .arg("--socket")
            .arg(socket)
            .arg("--mem-file")
            .arg(mem)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// Starts `guestmem serve-uffd` and waits for its socket.
fn server(socket: &Path, mem: &Path, extra: &[&str]) -> Guard {
    let mut g = spawn_server(socket, mem, extra);
    let t = Instant::now();
    while !socket.exists() {
        assert!(g.running(), "the server exited before listening");
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    g
}

/// Waits (at most 20 s) for the server to exit; its status, stdout and stderr.
fn finish(mut g: Guard) -> (i32, String, String) {
    let status = g.wait_exit(20);
    let c = g.child();
    let (mut out, mut err) = (String::new(), String::new());
    c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code().unwrap_or(-1), out, err)
}

/// What a stand-in VM in a child process does (see `standin_child`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum ChildDoes {
    /// Sends Firecracker's handshake, then waits for the parent's go file and reads every
    /// page, comparing each with the memory file.
    Handshake,
    /// Sends garbage with its userfaultfd.
    Garbage,
}

/// Environment variables that make this test binary a stand-in VM.
const CHILD_SOCKET: &str = "GM_TEST_STANDIN_SOCKET";
const CHILD_SIZE: &str = "GM_TEST_STANDIN_SIZE";
const CHILD_FEATURES: &str = "GM_TEST_STANDIN_FEATURES";
const CHILD_DOES: &str = "GM_TEST_STANDIN_DOES";
const CHILD_GO: &str = "GM_TEST_STANDIN_GO";
/// A stand-in child's exit code when the server refused its connection.
const CHILD_REFUSED: i32 = 3;

/// Not a test of its own: run by `vm_child` as a separate process, so that a server that
/// kills its peer kills the child, not the test.
#[test]
fn standin_child() {
    let Ok(socket) = std::env::var(CHILD_SOCKET) else {
        return;
    };
    let size: usize = std::env::var(CHILD_SIZE).unwrap().parse().unwrap();
    let features: u64 = std::env::var(CHILD_FEATURES).unwrap().parse().unwrap();
    let mut vm = Standin::with_features(&[size], features).unwrap();
    let sent = match std::env::var(CHILD_DOES).unwrap().as_str() {
        "Garbage" => vm.send(Path::new(&socket), b"[{not json", true),
        _ => vm.connect(Path::new(&socket)),
    };
    if sent.is_err() {
        // Refused at connect: exit with a code of its own.
        std::process::exit(CHILD_REFUSED);
    }
    println!("SENT");
    let go = PathBuf::from(std::env::var(CHILD_GO).unwrap());
    let t = Instant::now();
    while !go.exists() && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(5));
    }
    for p in 0..size / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64), "page {p}");
    }
    println!("READ");
    std::thread::sleep(Duration::from_secs(60));
}

/// A stand-in VM in a child process: `does` to `socket`, with `size` bytes of memory and the
/// userfaultfd `features`; it reads its memory once `go` exists.
fn vm_child(socket: &Path, size: usize, features: u64, does: ChildDoes, go: &Path) -> Guard {
    Guard::new(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "standin_child",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(CHILD_SOCKET, socket)
            .env(CHILD_SIZE, size.to_string())
            .env(CHILD_FEATURES, features.to_string())
            .env(CHILD_DOES, format!("{does:?}"))
            .env(CHILD_GO, go)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn serves_firecrackers_handshake_to_several_threads_with_balloon_removes() {
    need_uffd!();
    let d = dir("serve");
    let sizes = [24 * MIB, 8 * MIB];
    // The MiB at 20 MiB is a hole in the file: served as zero pages.
    let mem = mem_file(&d, 32 * MIB, Some(20 * MIB));
    let socket = d.join("uffd.sock");
    let record = d.join("ws.json");
    let srv = server(
        &socket,
        &mem,
        // Faults alone: the record is of what the VM touched.
        &[
            "--threads",
            "2",
            "--prefetch-threads",
            "0",
            "--record",
            record.to_str().unwrap(),
        ],
    );
    let mut vm = Standin::new(&sizes, true).unwrap();
    vm.connect(&socket).unwrap();
    // The balloon takes 64 KiB before anything was read there...
    let early = 3 * MIB + 5 * PAGE;
    vm.remove(early, 16 * PAGE).unwrap();
    let run = vm.read_all(4);
    assert!(run.seconds > 0.0);
    // ...and 8 KiB at the start of the second region after it was.
    let late = 24 * MIB + 7 * PAGE;
    vm.remove(late, 2 * PAGE).unwrap();
    for p in 0..32 * MIB / PAGE {
        let at = p * PAGE;
        let removed =
            (early..early + 16 * PAGE).contains(&at) || (late..late + 2 * PAGE).contains(&at);
        let hole = (20 * MIB..21 * MIB).contains(&at);
        let want = if removed || hole { 0 } else { word(at as u64) };
        assert_eq!(
            vm.word(at),
            want,
            "page at {at:#x} (removed {removed}, hole {hole})"
        );
        assert_eq!(
            vm.word(at + 4088),
            if removed || hole {
                0
            } else {
                word(at as u64 + 4088)
            }
        );
    }
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("until the peer closed the socket"), "{out}");
    assert!(out.contains("2 removes"), "{out}");
    // Every block came in for a fault, once each (a remove claims no block).
    let ws: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    let offsets = ws["offsets"].as_array().unwrap();
    assert_eq!(offsets.len(), 32, "{ws}");

    // Again, prefetching the recorded set: the same contents.
    let srv = server(
        &socket,
        &mem,
        &[
            "--threads",
            "2",
            "--prefetch",
            record.to_str().unwrap(),
            "--json",
        ],
    );
    let mut vm = Standin::new(&sizes, false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // Give the prefetch a moment to finish what the readers did not wait for.
    std::thread::sleep(Duration::from_millis(200));
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    let rep: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        rep["engine"]["prefetched_blocks"].as_u64().unwrap() > 0,
        "{out}"
    );
    assert_eq!(rep["engine"]["prefetched_working_set"], 32, "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_disconnect_mid_run_ends_the_server_cleanly() {
    need_uffd!();
    let d = dir("disconnect");
    let mem = mem_file(&d, 64 * MIB, None);
    let socket = d.join("uffd.sock");
    // Faults alone: what is in when the VM goes is what it read.
    let srv = server(
        &socket,
        &mem,
        &["--threads", "1", "--prefetch-threads", "0"],
    );
    let mut vm = Standin::new(&[64 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    // Read a quarter, then the VM goes away while most of its memory is still out.
    for p in 0..16 * MIB / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64));
    }
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("until the peer closed the socket"), "{out}");
    assert!(out.contains("16 of 64 blocks in"), "{out}");
    assert!(!socket.exists(), "the socket file is removed");
    vm.release().unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_handshakes_get_a_clear_error_and_a_clean_exit() {
    need_uffd!();
    let d = dir("bad");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let region = |vm: &Standin, i: usize| {
        let r = &vm.wire_regions()[i];
        (r.base_host_virt_addr, r.size)
    };
    type Send = Box<dyn Fn(&mut Standin, &Path)>;
    // (name, sizes, what the peer sends, whether it handed over its userfaultfd, message)
    let cases: Vec<(&str, Vec<usize>, Send, bool, &str)> = vec![
        (
            "garbage",
            vec![4 * MIB],
            Box::new(|vm, s| vm.send(s, b"\x00\x01 not json at all", true).unwrap()),
            true,
            "not Firecracker's JSON array of regions",
        ),
        (
            "no descriptor",
            vec![4 * MIB],
            Box::new(|vm, s| {
                let json = serde_json::to_vec(&vm.wire_regions()).unwrap();
                vm.send(s, &json, false).unwrap()
            }),
            false,
            "no file descriptor came with the message",
        ),
        (
            "not a userfaultfd",
            vec![4 * MIB],
            Box::new(|vm, s| {
                let json = serde_json::to_vec(&vm.wire_regions()).unwrap();
                let f = std::fs::File::open("/dev/null").unwrap();
                vm.send_other_fd(s, &json, &f).unwrap()
            }),
            false,
            "is /dev/null, not a userfaultfd",
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
            true,
            "40000 regions; at most 32764",
        ),
        (
            "overlapping regions",
            vec![2 * MIB, 2 * MIB],
            Box::new(move |vm, s| {
                let (a, _) = region(vm, 0);
                let json = format!(
                    r#"[{{"base_host_virt_addr":{a},"size":2097152,"offset":0,"page_size":4096}},
                        {{"base_host_virt_addr":{},"size":2097152,"offset":2097152,"page_size":4096}}]"#,
                    a + 4096
                );
                vm.send(s, json.as_bytes(), true).unwrap()
            }),
            true,
            "overlap in the peer's address space",
        ),
        (
            "disconnect mid-handshake",
            vec![4 * MIB],
            Box::new(|vm, s| {
                vm.send(s, br#"[{"base_host_virt_addr":1234"#, true)
                    .unwrap();
                vm.disconnect();
            }),
            true,
            "the peer disconnected mid-handshake",
        ),
        (
            "memory file shorter than the regions",
            vec![8 * MIB],
            Box::new(|vm, s| vm.connect(s).unwrap()),
            true,
            "holds 0x400000 bytes, but region 0",
        ),
    ];
    for (name, sizes, send, vm_sent_uffd, says) in cases {
        // The peer is this test process: leave it (the kill is tested with child peers).
        let srv = server(
            &socket,
            &mem,
            &[
                "--threads",
                "2",
                "--on-failure",
                "leave",
                "--accept-timeout-s",
                "3",
            ],
        );
        let mut vm = Standin::new(&sizes, false).unwrap();
        send(&mut vm, &socket);
        let (code, _, err) = finish(srv);
        assert_eq!(code, 1, "{name}: {err}");
        assert!(err.contains(says), "{name}: {err}");
        if vm_sent_uffd {
            // A VM that handed over its userfaultfd depends on the server: the refusal goes
            // through the failure policy, which says so.
            assert!(err.contains("left the peer"), "{name}: {err}");
        } else {
            // Not a VM: dropped, and the server listened on for a real one.
            assert!(
                err.contains("dropped a connection that is not a VM's"),
                "{name}: {err}"
            );
            assert!(
                err.contains("no VM connected within 3.0 s"),
                "{name}: {err}"
            );
        }
        assert!(!socket.exists(), "{name}: the socket file is left behind");
        // The VM's memory is untouched by the server: still registered with its own
        // descriptor, no page came in.
        vm.release().unwrap();
        assert_eq!(vm.word(0), 0, "{name}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The peer is ended through the pidfd taken when it connected: a refusal after it sent its
/// userfaultfd (findings 9, 14), a userfaultfd with fork events (finding 12), garbage, and a
/// memory file that fails mid-serve. With `--on-failure leave` it is left, and the log says so.
#[test]
fn a_vm_that_cannot_be_served_is_killed_through_its_pidfd() {
    need_uffd!();
    let d = dir("kill");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let fork = u64::from(linux_raw_sys::general::UFFD_FEATURE_EVENT_FORK);
    for (name, size, features, does, says) in [
        (
            "shorter file",
            8 * MIB,
            0,
            ChildDoes::Handshake,
            "holds 0x400000 bytes, but region 0",
        ),
        (
            "fork events",
            4 * MIB,
            fork,
            ChildDoes::Handshake,
            "UFFD_FEATURE_EVENT_FORK",
        ),
        (
            "garbage",
            4 * MIB,
            0,
            ChildDoes::Garbage,
            "not Firecracker's JSON",
        ),
    ] {
        for leave in [false, true] {
            let extra: &[&str] = if leave {
                &["--on-failure", "leave"]
            } else {
                &[]
            };
            let srv = server(&socket, &mem, extra);
            let mut vm = vm_child(&socket, size, features, does, &go);
            let (code, _, err) = finish(srv);
            assert_eq!(code, 1, "{name}: {err}");
            assert!(err.contains(says), "{name}: {err}");
            if leave {
                assert!(
                    err.contains(&format!("left the peer {}", vm.id())),
                    "{name}: {err}"
                );
                std::thread::sleep(Duration::from_millis(100));
                assert!(vm.running(), "{name}: a VM left is not killed");
            } else {
                assert!(
                    err.contains(&format!("killed the peer {} (through its pidfd)", vm.id())),
                    "{name}: {err}"
                );
                let st = vm.wait_exit(10);
                assert_eq!(st.signal(), Some(libc::SIGKILL), "{name}: {st:?}");
            }
        }
    }

    // Serving fails mid-run: the file is cut short after the handshake was accepted.
    let cut = d.join("cut");
    std::fs::copy(&mem, &cut).unwrap();
    // No prefetch: the file must still be needed when it is cut.
    let srv = server(
        &socket,
        &cut,
        &["--threads", "1", "--prefetch-threads", "0"],
    );
    let mut vm = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
    let t = Instant::now();
    // Wait for the server to have started serving (it says so once the handshake is in).
    std::thread::sleep(Duration::from_millis(300));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&cut)
        .unwrap()
        .set_len(0)
        .unwrap();
    std::fs::write(&go, b"").unwrap();
    let (code, _, err) = finish(srv);
    assert_eq!(code, 1, "{err}");
    // Mid-serve (the usual case) or, on a slow machine, at the start check: either way a
    // refusal after the VM sent its userfaultfd.
    assert!(
        err.contains("truncated") || err.contains("holds 0x0 bytes"),
        "{err}"
    );
    assert!(err.contains("killed the peer"), "{err}");
    assert_eq!(vm.wait_exit(10).signal(), Some(libc::SIGKILL));
    assert!(t.elapsed() < Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(&d);
}

/// CPU time (user + system) the process has used, in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// Finding 8: once every block is in, the server blocks: over 5 s it uses under 1% of a
/// core (it used a whole core, polling, before). BENCHMARKS.md has the measured figure.
#[test]
fn an_idle_server_blocks_instead_of_polling() {
    need_uffd!();
    let d = dir("idle");
    let mem = mem_file(&d, 16 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = server(
        &socket,
        &mem,
        &["--threads", "2", "--prefetch-threads", "2"],
    );
    let mut vm = Standin::new(&[16 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // Let the prefetch finish what the reads left, and the collapse to huge pages that
    // starts a second later (REGAIN_SETTLE; 16 MiB takes it well under a second); then
    // nothing is left to do.
    std::thread::sleep(guestmem::restore::REGAIN_SETTLE + Duration::from_millis(1500));
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let before = cpu_ticks(srv.id());
    std::thread::sleep(Duration::from_secs(5));
    let used = cpu_ticks(srv.id()) - before;
    eprintln!(
        "idle server: {used} clock ticks of CPU in 5 s ({:.2}% of a core; {hz} ticks a second)",
        used as f64 * 100.0 / (5 * hz) as f64
    );
    assert!(
        used * 100 < 5 * hz,
        "an idle server used {used} ticks of {} in 5 s: more than 1% of a core",
        5 * hz
    );
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("16 of 16 blocks in"), "{out}");
    let _ = std::fs::remove_dir_all(&d);
}

/// Findings 10 and 15: the socket appears only once it listens (a VMM that connects the
/// moment the path exists is never refused); a connection that says nothing is dropped
/// after the handshake timeout while the server listens on, and one still pending does not
/// hold up the real VM behind it.
#[test]
fn the_socket_listens_once_it_appears_and_squatters_hold_nobody_up() {
    need_uffd!();
    let d = dir("squat");
    let mem = mem_file(&d, 8 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = spawn_server(&socket, &mem, &["--handshake-timeout-s", "1"]);
    let t = Instant::now();
    while !socket.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::hint::spin_loop();
    }
    // The first to connect, at once: never ECONNREFUSED. It sends nothing.
    let early = std::os::unix::net::UnixStream::connect(&socket)
        .expect("the socket listens as soon as its path exists");
    // Dropped after the 1 s handshake timeout; the server listens on.
    std::thread::sleep(Duration::from_millis(1500));
    // A second squatter stays connected and silent while the real VM connects.
    let squatter = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    let mut vm = Standin::new(&[8 * MIB], false).unwrap();
    let t = Instant::now();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // Served while the squatter's handshake was still pending (it has a second left at most
    // when the VM connected; the VM did not wait for it to be dropped first).
    let served = t.elapsed();
    // A one-VM server stops listening once it has its VM: a second VM is refused at
    // connect, not left waiting on a server that will never serve it.
    assert!(std::os::unix::net::UnixStream::connect(&socket).is_err());
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("until the peer closed the socket"), "{out}");
    assert!(
        err.contains("dropped a connection that is not a VM's")
            && err.contains("nothing received within 1.0 s"),
        "{err}"
    );
    eprintln!("served 8 MiB in {served:?} beside a pending squatter");
    drop((early, squatter));
    assert!(!socket.exists());
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 10: a second server on a live socket is refused and the first keeps it; a server
/// removes the path on exit only while it still names its own socket; a path that is not a
/// socket is never replaced.
#[test]
fn a_socket_is_never_taken_from_another_server_or_replaced_if_not_a_socket() {
    need_uffd!();
    let d = dir("sockets");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let first = server(&socket, &mem, &["--accept-timeout-s", "3"]);
    let (code, _, err) = finish(spawn_server(&socket, &mem, &[]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("another server listens there"), "{err}");
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_ok(),
        "the first keeps it"
    );
    // Another socket is moved over the path while the first server runs: on its exit the
    // first must leave that one alone.
    let other_path = d.join("other.sock");
    let _other = std::os::unix::net::UnixListener::bind(&other_path).unwrap();
    std::fs::rename(&other_path, &socket).unwrap();
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(&socket).unwrap().ino();
    let (code, _, err) = finish(first);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no VM connected within 3.0 s"), "{err}");
    assert_eq!(
        std::fs::metadata(&socket).unwrap().ino(),
        ino,
        "not ours: left in place"
    );
    std::fs::remove_file(&socket).unwrap();
    // A regular file at the path is refused, untouched.
    std::fs::write(&socket, b"not a socket").unwrap();
    let (code, _, err) = finish(spawn_server(&socket, &mem, &[]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("exists and is not a socket"), "{err}");
    assert_eq!(std::fs::read(&socket).unwrap(), b"not a socket");
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 11: `--record` is checked before the server listens (a missing directory, a
/// symlink), and written whole (no temporary left).
#[test]
fn record_is_checked_before_listening_and_written_whole() {
    need_uffd!();
    let d = dir("record");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let victim = d.join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let link = d.join("link.json");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    for (record, says) in [
        (d.join("missing/ws.json"), "missing"),
        (link.clone(), "not a regular file"),
    ] {
        let (code, _, err) = finish(spawn_server(
            &socket,
            &mem,
            &["--record", record.to_str().unwrap()],
        ));
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(says), "{err}");
        assert!(
            !err.contains("listening on"),
            "refused before listening: {err}"
        );
        assert!(!socket.exists());
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    let record = d.join("ws.json");
    let srv = server(
        &socket,
        &mem,
        &[
            "--prefetch-threads",
            "0",
            "--record",
            record.to_str().unwrap(),
        ],
    );
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(1);
    vm.disconnect();
    let (code, _, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    let ws: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    assert_eq!(ws["offsets"].as_array().unwrap().len(), 4);
    let mut names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["link.json", "memory", "victim", "ws.json"],
        "nothing else left"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// Finding 4: a block size past the cap (each serving thread stages one block) is refused
/// before the server listens (`--block 4G` on a 16 MiB file used 4.4 GB before).
#[test]
fn a_block_past_the_cap_is_refused_before_listening() {
    let d = dir("block");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let (code, _, err) = finish(spawn_server(&socket, &mem, &["--block", "4G"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("block size 0x100000000") && err.contains("0x4000000"),
        "{err}"
    );
    assert!(!socket.exists());
    let _ = std::fs::remove_dir_all(&d);
}

/// A one-VM server with two VMs at its door: it serves one and ends the other through its
/// pidfd (neither is left waiting on a server that will never serve it).
#[test]
fn a_second_vm_at_once_is_ended_not_left_hung() {
    need_uffd!();
    let d = dir("two-vms");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let srv = server(&socket, &mem, &[]);
    let mut a = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
    let mut b = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
    std::fs::write(&go, b"").unwrap();
    // One of them is killed; the other is served and stays up.
    let t = Instant::now();
    let killed = loop {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "neither VM was ended"
        );
        if !a.running() {
            break 'a';
        }
        if !b.running() {
            break 'b';
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let (dead, alive) = if killed == 'a' {
        (&mut a, &mut b)
    } else {
        (&mut b, &mut a)
    };
    // Ended: killed through its pidfd if its handshake reached the server, or refused at
    // connect if it came after the server stopped listening.
    let st = dead.wait_exit(5);
    let was_killed = st.signal() == Some(libc::SIGKILL);
    eprintln!(
        "the second VM was {}",
        if was_killed {
            "killed"
        } else {
            "refused at connect"
        }
    );
    assert!(was_killed || st.code() == Some(CHILD_REFUSED), "{st:?}");
    std::thread::sleep(Duration::from_millis(200));
    assert!(alive.running(), "the VM being served is left alone");
    // The served VM goes away: the server ends cleanly.
    drop(std::mem::replace(alive, Guard::none()));
    let (code, _, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    if was_killed {
        assert!(err.contains("serves one VM and has it"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// The handshake timeout is for the whole handshake: a peer that trickles its JSON a byte at
/// a time is cut off when it runs out, not kept for as long as it keeps trickling.
#[test]
fn a_trickling_handshake_is_cut_off_at_its_deadline() {
    need_uffd!();
    let d = dir("trickle");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = server(
        &socket,
        &mem,
        &["--handshake-timeout-s", "1", "--on-failure", "leave"],
    );
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.send(&socket, b"[", true).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickler = {
        let (stop, socket) = (stop.clone(), socket.clone());
        // A second, plain connection cannot add to the first's stream: the stand-in's own
        // socket is written through a duplicate of its descriptor.
        let s = vm.socket_clone().unwrap();
        std::thread::spawn(move || {
            let _ = socket;
            let t = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && t.elapsed() < Duration::from_secs(10)
            {
                if (&s).write_all(b" ").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let t = Instant::now();
    let (code, _, err) = finish(srv);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickler.join().unwrap();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("the handshake was not whole within 1.0 s"),
        "{err}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(8),
        "cut off at its deadline"
    );
    vm.release().unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// Starts `guestmem serve-uffd` as a fleet over `pairs` (socket, memory file) and waits for
/// every socket.
fn fleet(pairs: &[(&Path, &Path)], extra: &[&str]) -> Guard {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
    cmd.arg("serve-uffd");
    for (socket, mem) in pairs {
        cmd.arg("--socket").arg(socket).arg("--mem-file").arg(mem);
    }
    let mut g = Guard::new(
        cmd.args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while !pairs.iter().all(|(s, _)| s.exists()) {
        assert!(g.running(), "the server exited before listening");
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    g
}

/// The `Threads:` line of `/proc/PID/status`.
fn threads_of(pid: u32) -> usize {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Sends SIGTERM to the server and waits (at most 5 s) for it to exit: its status, stdout,
/// stderr and how long it took.
fn terminate(mut g: Guard) -> (i32, String, String, Duration) {
    let t = Instant::now();
    // SAFETY: kill on our own child's pid (the guard has not reaped it yet).
    assert_eq!(unsafe { libc::kill(g.id() as i32, libc::SIGTERM) }, 0);
    let status = g.wait_exit(5);
    let took = t.elapsed();
    let c = g.child();
    let (mut out, mut err) = (String::new(), String::new());
    c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    (status.code().unwrap_or(-1), out, err, took)
}

#[test]
fn one_server_serves_twenty_vms_of_two_snapshots_and_graduates_them_on_sigterm() {
    need_uffd!();
    const VMS: usize = 20;
    const SIZE: usize = 16 * MIB;
    let d = dir("fleet");
    // Two snapshots: the second has a hole at 5 MiB, so a VM served from the wrong file
    // reads the wrong bytes there.
    let a_dir = d.join("a");
    let b_dir = d.join("b");
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    let mem_a = mem_file(&a_dir, SIZE, None);
    let mem_b = mem_file(&b_dir, SIZE, Some(5 * MIB));
    let (sock_a, sock_b) = (d.join("a.sock"), d.join("b.sock"));
    // The stand-ins are threads of this process: a server that ended one would end the
    // test, so failures are left (and the test fails on what the VM reads).
    let srv = fleet(
        &[(&sock_a, &mem_a), (&sock_b, &mem_b)],
        &["--threads", "2", "--on-failure", "leave"],
    );
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
    // Every VM touches the first half of its memory at once, each page checked.
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
    // One pool serves them all: not a thread (or several) per VM.
    let threads = threads_of(srv.id());
    assert!(
        threads < VMS,
        "{threads} threads serve {VMS} VMs: the pool should be shared"
    );
    // Drain: every VM graduates (the second half is brought in, then unregistered).
    let (code, out, err, took) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(took < Duration::from_secs(5), "drained in {took:?}");
    assert_eq!(
        out.matches("graduated (every block in, unregistered)")
            .count(),
        VMS,
        "{out}\n{err}"
    );
    assert!(!sock_a.exists() && !sock_b.exists(), "sockets removed");
    // With the server gone, every page is there: nothing reads zero in its place, and no
    // read waits (the ranges are unregistered).
    for (i, vm) in vms.iter().enumerate() {
        for p in 0..SIZE / PAGE {
            let at = p * PAGE;
            assert_eq!(vm.word(at), want(i, at), "VM {i}, page at {at:#x}");
            assert_eq!(vm.word(at + 4088), want(i, at + 4088), "VM {i}");
        }
    }
}

#[test]
fn a_fleet_ends_only_the_vm_it_cannot_serve_and_refuses_past_its_limit() {
    need_uffd!();
    let d = dir("fleet-fail");
    let mem = mem_file(&d, 8 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let srv = fleet(&[(&socket, &mem)], &["--threads", "2", "--max-vms", "2"]);
    let mut a = Standin::new(&[8 * MIB], false).unwrap();
    a.connect(&socket).unwrap();
    assert_eq!(a.word(0), word(0));
    // A VM whose regions do not fit the memory file: ended through its pidfd.
    let mut big = vm_child(&socket, 16 * MIB, 0, ChildDoes::Handshake, &go);
    let status = big.wait_exit(10);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    // A connection that sends nothing: dropped after the handshake timeout, harmlessly.
    let _idle = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    // A second VM is served beside the first...
    let mut c = Standin::new(&[8 * MIB], false).unwrap();
    c.connect(&socket).unwrap();
    // Served before the third comes: handshakes finish in any order, and the one refused
    // at the limit must be the child, never this process.
    assert_eq!(c.word(0), word(0));
    // ...and a third is past --max-vms 2: refused and ended.
    let mut third = vm_child(&socket, 8 * MIB, 0, ChildDoes::Handshake, &go);
    let status = third.wait_exit(10);
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    // The two served VMs read all their memory right.
    assert_eq!(a.compare(&mem).unwrap(), Ok(()));
    assert_eq!(c.compare(&mem).unwrap(), Ok(()));
    // One goes: its session ends, the server goes on.
    c.disconnect();
    drop(c);
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("holds 0x800000 bytes, but region 0"), "{err}");
    assert!(
        err.contains("refused at a limit: VMs served at once: 2 in use"),
        "{err}"
    );
    assert!(err.contains("killed the peer"), "{err}");
    assert!(out.contains("closed its socket"), "{out}");
    assert!(out.contains("graduated"), "{out}");
    assert_eq!(a.compare(&mem).unwrap(), Ok(()));
}

#[test]
fn a_kill_9_of_the_server_loses_no_vm_and_no_page() {
    need_uffd!();
    const SIZE: usize = 32 * MIB;
    let d = dir("fleet-kill");
    let mem = mem_file(&d, SIZE, Some(9 * MIB));
    let socket = d.join("uffd.sock");
    let state = d.join("state");
    // Faults alone, so that most of the memory is still to serve across the restart.
    let args = [
        "--threads",
        "2",
        "--prefetch-threads",
        "0",
        "--on-failure",
        "leave",
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let mut first = fleet(&[(&socket, &mem)], &args);
    let mut vms: Vec<Standin> = (0..2)
        .map(|_| Standin::new(&[SIZE], false).unwrap())
        .collect();
    for vm in &mut vms {
        vm.connect(&socket).unwrap();
    }
    let want = |at: usize| {
        if (9 * MIB..10 * MIB).contains(&at) {
            0
        } else {
            word(at as u64)
        }
    };
    // Both sessions are recorded before the VMs run.
    let t = Instant::now();
    // (The socket is bound before the state directory is made: it may not be there yet.)
    let records = || {
        std::fs::read_dir(&state).map_or(0, |d| {
            d.filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_str().unwrap().starts_with("session-")
            })
            .count()
        })
    };
    while records() < 2 {
        assert!(t.elapsed() < Duration::from_secs(10), "no session records");
        std::thread::sleep(Duration::from_millis(5));
    }
    let read = std::sync::atomic::AtomicUsize::new(0);
    let stalls: Vec<Duration> = std::thread::scope(|s| {
        let readers: Vec<_> = vms
            .iter()
            .map(|vm| {
                let read = &read;
                s.spawn(move || {
                    let mut worst = Duration::ZERO;
                    for p in 0..SIZE / PAGE {
                        let at = p * PAGE;
                        let t = Instant::now();
                        let got = (vm.word(at), vm.word(at + 4088));
                        worst = worst.max(t.elapsed());
                        assert_eq!(got, (want(at), want(at + 4088)), "page at {at:#x}");
                        read.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if p % 64 == 0 {
                            // Guest work between touches: the kill lands mid-run.
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                    worst
                })
            })
            .collect();
        // Kill the server a quarter of the way in (both VMs have sessions recorded).
        let t = Instant::now();
        while read.load(std::sync::atomic::Ordering::Relaxed) < SIZE / PAGE / 2 {
            // Half of one VM's pages: a quarter of all.
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the VMs made no progress"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: kill on our own child's pid.
        assert_eq!(unsafe { libc::kill(first.id() as i32, libc::SIGKILL) }, 0);
        first.wait_exit(5);
        let at_kill = read.load(std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            read.load(std::sync::atomic::Ordering::Relaxed) < 2 * SIZE / PAGE,
            "the VMs are frozen without a server (read {at_kill} pages at the kill)"
        );
        // A new server on the same state takes both VMs back.
        let second = fleet(&[(&socket, &mem)], &args);
        let stalls = readers.into_iter().map(|r| r.join().unwrap()).collect();
        let (code, out, err, _) = terminate(second);
        assert_eq!(code, 0, "{err}");
        assert_eq!(err.matches("took back peer").count(), 2, "{err}");
        assert_eq!(out.matches("graduated").count(), 2, "{out}");
        stalls
    });
    eprintln!(
        "longest guest stall across the restart: {:?}",
        stalls.iter().max()
    );
    for vm in &vms {
        for p in 0..SIZE / PAGE {
            assert_eq!(vm.word(p * PAGE), want(p * PAGE));
        }
    }
    assert_eq!(
        std::fs::read_dir(&state).unwrap().count(),
        0,
        "records removed once the sessions ended"
    );
}

#[test]
fn a_fleet_tells_systemd_it_is_ready_once_it_listens() {
    need_uffd!();
    let d = dir("notify");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let notify = d.join("notify.sock");
    let rx = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let srv = Guard::new(
        Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .args(["serve-uffd", "--socket"])
            .arg(&socket)
            .arg("--mem-file")
            .arg(&mem)
            .env("NOTIFY_SOCKET", &notify)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut buf = [0u8; 256];
    let n = rx.recv(&mut buf).expect("a notification within 20 s");
    let msg = std::str::from_utf8(&buf[..n]).unwrap();
    assert!(msg.starts_with("READY=1\n"), "{msg:?}");
    assert!(socket.exists(), "ready only once the socket listens");
    let (code, _, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_second_server_on_the_same_state_dir_is_refused() {
    need_uffd!();
    let d = dir("fleet-state-lock");
    let mem = mem_file(&d, 4 * MIB, None);
    let state = d.join("state");
    let args = ["--state-dir", state.to_str().unwrap()];
    let (a, b) = (d.join("a.sock"), d.join("b.sock"));
    let first = fleet(&[(&a, &mem)], &args);
    // Two servers would both serve the VMs the records name.
    let (code, _, err) = finish(Guard::new(
        Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .args(["serve-uffd", "--socket"])
            .arg(&b)
            .arg("--mem-file")
            .arg(&mem)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    assert_ne!(code, 0);
    assert!(err.contains("another server holds it"), "{err}");
    let (code, _, err, _) = terminate(first);
    assert_eq!(code, 0, "{err}");
}

/// Runs `guestmem serve-ctl --control PATH COMMAND`; its stdout.
fn ctl(control: &Path, command: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_guestmem"))
        .args(["serve-ctl", "--control"])
        .arg(control)
        .arg(command)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `GET path` from 127.0.0.1:`port`; the whole response.
fn http_get(port: u16, path: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn status_metrics_and_drain_over_the_control_socket() {
    need_uffd!();
    let d = dir("fleet-ctl");
    let mem = mem_file(&d, 8 * MIB, Some(3 * MIB));
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut srv = fleet(
        &[(&socket, &mem)],
        &[
            "--control",
            control.to_str().unwrap(),
            "--metrics",
            &addr,
            "--on-failure",
            "leave",
            // Faults alone: the counts below are the VM's.
            "--prefetch-threads",
            "0",
        ],
    );
    let t = Instant::now();
    while !control.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no control socket");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Only this user may command the server (a hand-off gives away every VM's memory).
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&control).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode {mode:o}");
    let mut vms: Vec<Standin> = (0..2)
        .map(|_| Standin::new(&[8 * MIB], false).unwrap())
        .collect();
    for vm in &mut vms {
        vm.connect(&socket).unwrap();
        vm.read_all(2);
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    }
    let health = ctl(&control, "health");
    assert!(
        health.contains("\"ok\":true") && health.contains("\"vms\":2"),
        "{health}"
    );
    let status: serde_json::Value = serde_json::from_str(&ctl(&control, "status")).unwrap();
    let sessions = status["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 2, "{status}");
    for s in sessions {
        // 8 blocks of 1 MiB, one of them a hole: every block came in for a fault.
        assert_eq!(s["engine"]["fault_blocks"], 8, "{s}");
        assert!(s["engine"]["first_fault_secs"].as_f64().is_some(), "{s}");
    }
    let lat = &status["sockets"][0]["fault_latency"];
    assert_eq!(lat["file"]["count"], 14, "{status}");
    assert_eq!(lat["zero"]["count"], 2, "{status}");
    assert!(lat["file"]["p99_us"].as_f64().unwrap() > 0.0, "{status}");
    let metrics = http_get(port, "/metrics");
    assert!(metrics.starts_with("HTTP/1.0 200 OK"), "{metrics}");
    assert!(metrics.contains("guestmem_fleet_vms 2"), "{metrics}");
    assert!(
        metrics.contains("guestmem_fault_latency_seconds_count{socket=\"0\",class=\"file\"} 14"),
        "{metrics}"
    );
    assert!(http_get(port, "/health").ends_with("ok\n"));
    assert!(http_get(port, "/nothing").starts_with("HTTP/1.0 404"));
    // A drain through the control socket: every VM graduates, the server exits 0.
    assert!(ctl(&control, "drain").contains("\"draining\":true"));
    let status = srv.wait_exit(10);
    assert_eq!(status.code(), Some(0));
    assert!(!control.exists(), "the control socket is removed");
}

#[test]
fn a_working_set_learnt_from_one_clone_is_prefetched_for_the_next() {
    need_uffd!();
    let d = dir("fleet-learn");
    let mem = mem_file(&d, 16 * MIB, None);
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let srv = fleet(
        &[(&socket, &mem)],
        &[
            "--learn-working-sets",
            // Learnt from faults: no prefetch of the rest to get there first (a learnt
            // set is still prefetched).
            "--prefetch-threads",
            "0",
            "--control",
            control.to_str().unwrap(),
            "--on-failure",
            "leave",
            "--json",
        ],
    );
    let learnt = d.join("memory.guestmem-ws.json");
    // The first clone touches the second half, last MiB first.
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
    // The next clone gets those blocks prefetched: wait for them, then touch the same.
    let mut next = Standin::new(&[16 * MIB], false).unwrap();
    next.connect(&socket).unwrap();
    let t = Instant::now();
    loop {
        let st: serde_json::Value = serde_json::from_str(&ctl(&control, "status")).unwrap();
        let s = st["sessions"].as_array().unwrap();
        if s.len() == 1 && s[0]["engine"]["prefetched_blocks"].as_u64().unwrap() >= 8 {
            assert_eq!(s[0]["engine"]["prefetched_working_set"], 8, "{st}");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "no prefetch: {st}");
        std::thread::sleep(Duration::from_millis(10));
    }
    touch(&next);
    // Faults avoided: none of the blocks the first clone faulted was faulted again.
    let st: serde_json::Value = serde_json::from_str(&ctl(&control, "status")).unwrap();
    assert_eq!(st["sessions"][0]["engine"]["fault_blocks"], 0, "{st}");
    assert_eq!(next.compare(&mem).unwrap(), Ok(()));
    next.disconnect();
    drop((first, next));
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    let rep: serde_json::Value = serde_json::from_str(&out).unwrap();
    let faults: Vec<u64> = rep["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["engine"]["fault_blocks"].as_u64().unwrap())
        .collect();
    // The first clone faulted its 8 blocks in (the next one's compare then read the first
    // half too, faulting in what the prefetch of the rest had not brought yet).
    assert_eq!(faults[0], 8, "{out}");
}

#[test]
fn a_fleet_hands_its_sockets_and_vms_to_a_new_server_without_downtime() {
    need_uffd!();
    const SIZE: usize = 16 * MIB;
    let d = dir("fleet-handoff");
    let mem = mem_file(&d, SIZE, Some(5 * MIB));
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let state = d.join("state");
    // Both servers keep records: the VMs handed over must not be taken back a second time
    // from the records the old server left.
    // Faults alone, so that half the memory is still to serve after the hand-off.
    let args = [
        "--control",
        control.to_str().unwrap(),
        "--on-failure",
        "leave",
        "--prefetch-threads",
        "0",
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let mut old = fleet(&[(&socket, &mem)], &args);
    let t = Instant::now();
    while !control.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no control socket");
        std::thread::sleep(Duration::from_millis(5));
    }
    let want = |at: usize| {
        if (5 * MIB..6 * MIB).contains(&at) {
            0
        } else {
            word(at as u64)
        }
    };
    let mut first = Standin::new(&[SIZE], false).unwrap();
    first.connect(&socket).unwrap();
    for p in 0..SIZE / 2 / PAGE {
        assert_eq!(first.word(p * PAGE), want(p * PAGE));
    }
    // The new server takes over (the same socket and file, the same control path).
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
    cmd.args(["serve-uffd", "--socket"])
        .arg(&socket)
        .arg("--mem-file")
        .arg(&mem)
        .arg("--take-over")
        .arg(&control)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut new = Guard::new(cmd.spawn().unwrap());
    let status = old.wait_exit(20);
    assert_eq!(status.code(), Some(0), "the old server exits 0");
    let mut out = String::new();
    old.child()
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(out.contains("handed to the new server"), "{out}");
    assert!(
        socket.exists(),
        "the socket path stays through the hand-off"
    );
    std::thread::sleep(Duration::from_millis(200));
    if !new.running() {
        let mut err = String::new();
        new.child()
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        panic!("the new server exited: {err}");
    }
    // The VM goes on: the rest of its memory comes from the new server.
    let t = Instant::now();
    for p in SIZE / 2 / PAGE..SIZE / PAGE {
        assert_eq!(first.word(p * PAGE), want(p * PAGE), "page {p}");
    }
    eprintln!(
        "the second half read in {:?} across the hand-off",
        t.elapsed()
    );
    // A new VM connects on the socket the new server was handed.
    let mut second = Standin::new(&[SIZE], false).unwrap();
    second.connect(&socket).unwrap();
    for p in 0..SIZE / PAGE {
        assert_eq!(second.word(p * PAGE), want(p * PAGE));
    }
    let (code, out, err, _) = terminate(new);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("took over 1 VMs"), "{err}");
    assert!(!err.contains("took back peer"), "served twice: {err}");
    assert_eq!(out.matches("graduated").count(), 2, "{out}\n{err}");
    for vm in [&first, &second] {
        for p in 0..SIZE / PAGE {
            assert_eq!(vm.word(p * PAGE), want(p * PAGE));
        }
    }
}

#[test]
fn json_logs_carry_one_structured_event_per_session_start_and_end() {
    need_uffd!();
    let d = dir("fleet-json");
    let mem = mem_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = fleet(
        &[(&socket, &mem)],
        &["--log-format", "json", "--on-failure", "leave"],
    );
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    vm.disconnect();
    std::thread::sleep(Duration::from_millis(200));
    let (code, _, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    let events: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let of = |kind: &str| {
        events
            .iter()
            .filter(|e| e["fields"]["event"] == kind)
            .collect::<Vec<_>>()
    };
    let start = of("start");
    assert_eq!(start.len(), 1, "{err}");
    assert_eq!(start[0]["fields"]["session"], 0);
    assert_eq!(start[0]["fields"]["bytes"], 4 * MIB as u64);
    assert_eq!(
        start[0]["fields"]["pid"].as_i64(),
        Some(std::process::id() as i64)
    );
    let end = of("end");
    assert_eq!(end.len(), 1, "{err}");
    assert_eq!(end[0]["fields"]["reason"], "PeerClosed", "{err}");
}

#[test]
fn a_memory_file_written_while_served_ends_its_vms_and_closes_its_socket() {
    need_uffd!();
    let d = dir("fleet-changed");
    let (a_dir, b_dir) = (d.join("a"), d.join("b"));
    std::fs::create_dir_all(&a_dir).unwrap();
    std::fs::create_dir_all(&b_dir).unwrap();
    let mem_a = mem_file(&a_dir, 8 * MIB, None);
    let mem_b = mem_file(&b_dir, 8 * MIB, None);
    let (sock_a, sock_b) = (d.join("a.sock"), d.join("b.sock"));
    let srv = fleet(
        &[(&sock_a, &mem_a), (&sock_b, &mem_b)],
        &["--on-failure", "leave"],
    );
    let mut a = Standin::new(&[8 * MIB], false).unwrap();
    a.connect(&sock_a).unwrap();
    let mut b = Standin::new(&[8 * MIB], false).unwrap();
    b.connect(&sock_b).unwrap();
    assert_eq!(a.word(0), word(0));
    // Someone writes snapshot A's file in place while its VM runs.
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
    // A's VM is ended (left, here: it is this process); B's is untouched.
    assert_eq!(b.compare(&mem_b).unwrap(), Ok(()));
    assert!(
        std::os::unix::net::UnixStream::connect(&sock_a).is_err(),
        "socket A takes no VM"
    );
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("changed while served"), "{err}");
    assert!(err.contains("left the peer"), "{err}");
    assert!(out.contains("graduated"), "{out}");
    // A's VM never read the changed page; releasing it wakes nothing.
    a.release().unwrap();
}

#[test]
fn a_fleet_serves_a_balloons_removes_as_zero_pages() {
    need_uffd!();
    let d = dir("fleet-balloon");
    let mem = mem_file(&d, 8 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = fleet(
        &[(&socket, &mem)],
        &["--threads", "2", "--on-failure", "leave"],
    );
    let mut vm = Standin::new(&[8 * MIB], true).unwrap();
    vm.connect(&socket).unwrap();
    // A remove before the block came in, and one after.
    let early = 5 * MIB + 3 * PAGE;
    vm.remove(early, 4 * PAGE).unwrap();
    assert_eq!(vm.word(0), word(0));
    let late = 7 * PAGE;
    vm.remove(late, 2 * PAGE).unwrap();
    vm.read_all(2);
    for p in 0..8 * MIB / PAGE {
        let at = p * PAGE;
        let removed =
            (early..early + 4 * PAGE).contains(&at) || (late..late + 2 * PAGE).contains(&at);
        let want = if removed { 0 } else { word(at as u64) };
        assert_eq!(vm.word(at), want, "page at {at:#x} (removed {removed})");
    }
    vm.disconnect();
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("closed its socket"), "{out}");
}

/// The fleet prefetches every VM from its handshake on, on its one pool of threads (not a
/// thread per VM): memory no vCPU touched comes in.
#[test]
fn a_fleet_prefetches_every_vm_on_its_pool_from_the_handshake() {
    need_uffd!();
    const SIZE: usize = 8 * MIB;
    let d = dir("fleet-prefetch");
    let mem = mem_file(&d, SIZE, Some(3 * MIB));
    let socket = d.join("uffd.sock");
    let srv = fleet(
        &[(&socket, &mem)],
        &["--threads", "1", "--on-failure", "leave"],
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
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "not prefetched: {} of {SIZE} bytes in",
                vm.resident().unwrap()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let threads = threads_of(srv.id());
    for vm in &mut vms {
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
        vm.disconnect();
    }
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    // Main, one pool thread, the huge-page collapser, a handshake thread or two at most.
    assert!(
        threads < 4 + 2,
        "{threads} threads for 4 VMs: a prefetch thread each?"
    );
    assert_eq!(out.matches(", 0 faults,").count(), 4, "{out}");
}

/// Once a VM's memory is all in, the server collapses it to huge pages in the VM's process
/// (process_madvise through its pidfd); `--regain-huge-pages off` leaves it on 4 KiB pages.
#[test]
fn a_served_vm_gets_huge_pages_back_once_all_its_memory_is_in() {
    need_uffd!();
    const SIZE: usize = 16 * MIB;
    let d = dir("fleet-regain");
    let mem = mem_file(&d, SIZE, None);
    for (switch, want_huge) in [("on", true), ("off", false)] {
        let socket = d.join(format!("uffd-{switch}.sock"));
        let srv = fleet(
            &[(&socket, &mem)],
            &["--on-failure", "leave", "--regain-huge-pages", switch],
        );
        let mut vm = Standin::new(&[SIZE], false).unwrap();
        vm.connect(&socket).unwrap();
        vm.read_all(2);
        assert_eq!(vm.anon_huge().unwrap(), 0, "UFFDIO_COPY fills 4 KiB pages");
        // The collapse runs in the background a second after the last block is in: wait for it
        // (at least 6 whole 2 MiB chunks lie in 16 MiB, however it is aligned).
        let t = Instant::now();
        while want_huge && vm.anon_huge().unwrap() < 6 * 2 * MIB as u64 {
            if t.elapsed() > Duration::from_secs(20) {
                let huge = vm.anon_huge().unwrap();
                let (_, out, err, _) = terminate(srv);
                panic!("no huge pages came back: {huge} bytes\n{out}\n{err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()), "{switch}");
        vm.disconnect();
        let (code, _, err, _) = terminate(srv);
        assert_eq!(code, 0, "{err}");
        if want_huge {
            assert!(err.contains("huge pages regained in process"), "{err}");
        } else {
            assert_eq!(vm.anon_huge().unwrap(), 0, "off: left on 4 KiB pages");
        }
    }
}

#[test]
fn two_mib_guests_are_served_a_huge_page_per_fault_and_bad_ones_refused_by_field() {
    need_uffd!();
    const SIZE: usize = 32 * MIB;
    let _host = guestmem_testkit::host_lock();
    // The stand-in's memory (16 pages) and a stand-in for each refusal below (1 page each,
    // never touched: reserved at mmap).
    let pool = match guestmem_testkit::HugePool2M::grow(16 + 3) {
        Ok(p) => p,
        Err(why) => {
            guestmem_testkit::skip(format_args!("{why}"));
            return;
        }
    };
    let d = dir("huge");
    let mem = mem_file(&d, SIZE, Some(6 * MIB));
    let socket = d.join("uffd.sock");
    // Faults alone: one per 2 MiB page touched.
    let srv = server(
        &socket,
        &mem,
        &["--threads", "2", "--prefetch-threads", "0", "--json"],
    );
    let mut vm = Standin::huge(&[SIZE], guestmem::HugePageSize::Size2M).unwrap();
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
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    let rep: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        rep["engine"]["faults"], 16,
        "one fault per 2 MiB page: {out}"
    );
    assert_eq!(rep["engine"]["fault_blocks"], 16, "{out}");
    assert_eq!(rep["engine"]["zero_blocks"], 0, "{out}");
    drop(vm);

    // A base or offset off a 2 MiB boundary, or a page size that is neither 4 KiB nor 2 MiB,
    // is refused naming the field (the VM, here this process, is left and the server exits).
    for (field, edit) in [
        (
            "base_host_virt_addr",
            &(|r: &mut serde_json::Value| {
                r["base_host_virt_addr"] =
                    (r["base_host_virt_addr"].as_u64().unwrap() + 4096).into()
            }) as &dyn Fn(&mut serde_json::Value),
        ),
        ("offset", &|r: &mut serde_json::Value| {
            r["offset"] = 4096.into()
        }),
        ("page_size", &|r: &mut serde_json::Value| {
            r["page_size"] = 8192.into();
            r["page_size_kib"] = 8192.into();
        }),
    ] {
        let srv = server(&socket, &mem, &["--on-failure", "leave"]);
        let mut bad = Standin::huge(&[2 * MIB], guestmem::HugePageSize::Size2M).unwrap();
        let mut regions = serde_json::to_value(bad.wire_regions()).unwrap();
        edit(&mut regions[0]);
        bad.send(&socket, regions.to_string().as_bytes(), true)
            .unwrap();
        let (code, _, err) = finish(srv);
        assert_ne!(code, 0, "{field}: {err}");
        assert!(err.contains(&format!("{field} ")), "{field}: {err}");
    }
    drop(pool);
}
