//! `guestmem serve-uffd --once` as a process: what it prints and writes, its exit code,
//! what it refuses before its socket appears, its socket's life, and that an idle server
//! uses no CPU. (What the server does with VMs is tested in the library, `guestmem`'s
//! `tests/serve.rs`.)

mod common;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use common::*;

guestmem_testkit::standin_child_test!();

/// A VM served until it goes: exit 0, what was done printed, the working set recorded
/// (`--record`), then prefetched by the next server (`--prefetch`, `--json`).
#[test]
fn a_vm_is_served_its_working_set_recorded_and_prefetched_next_time() {
    need_uffd!();
    let d = dir("once");
    let mem = memory_file(&d, 32 * MIB, Some(20 * MIB));
    let socket = d.join("uffd.sock");
    let record = d.join("ws.json");
    // Faults alone: the record is of what the VM touched.
    let srv = once(
        &socket,
        &mem,
        &[
            "--threads",
            "2",
            "--prefetch-threads",
            "0",
            "--record",
            record.to_str().unwrap(),
        ],
    );
    let mut vm = Standin::new(&[24 * MIB, 8 * MIB], true).unwrap();
    vm.connect(&socket).unwrap();
    vm.remove(3 * MIB, 4 * PAGE).unwrap();
    vm.read_all(4);
    assert_eq!(vm.word(20 * MIB), 0, "a hole reads as zero");
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("until peer-closed"), "{out}");
    assert!(out.contains("1 removes; 32 of 32 blocks in"), "{out}");
    let ws: serde_json::Value = serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    assert_eq!(ws["offsets"].as_array().unwrap().len(), 32, "{ws}");
    assert!(!socket.exists(), "the socket file is removed");

    let srv = once(
        &socket,
        &mem,
        &["--prefetch", record.to_str().unwrap(), "--json"],
    );
    let mut vm = Standin::new(&[24 * MIB, 8 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    let rep: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(rep["last"]["engine"]["prefetched_working_set"], 32, "{out}");
    assert_eq!(rep["last"]["end"], "peer-closed", "{out}");
}

/// A VM that sent its userfaultfd and cannot be served is killed through its pidfd (or
/// left, with `--on-failure leave`), and the server exits 1 naming why; a memory file cut
/// short mid-serve ends the VM the same way.
#[test]
fn a_vm_that_cannot_be_served_is_killed_and_the_server_exits_1() {
    need_uffd!();
    let d = dir("kill");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    for leave in [false, true] {
        let extra: &[&str] = if leave {
            &["--on-failure", "leave"]
        } else {
            &[]
        };
        let srv = once(&socket, &mem, extra);
        let mut vm = vm_child(&socket, 8 * MIB, 0, ChildDoes::Handshake, &go);
        let (code, _, err) = finish(srv);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("holds 0x400000 bytes, but region 0"), "{err}");
        if leave {
            assert!(err.contains(&format!("left the peer {}", vm.id())), "{err}");
            assert!(vm.running(), "a VM left is not killed");
        } else {
            let killed = format!("killed the peer {} (through its pidfd)", vm.id());
            assert!(err.contains(&killed), "{err}");
            assert_eq!(vm.wait_exit(10).signal(), Some(libc::SIGKILL));
        }
    }
    // Serving fails mid-run: the file is cut short after the VM was admitted.
    let cut = d.join("cut");
    std::fs::copy(&mem, &cut).unwrap();
    // No prefetch: the file must still be needed when it is cut.
    let srv = once(
        &socket,
        &cut,
        &["--threads", "1", "--prefetch-threads", "0"],
    );
    let mut vm = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
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
    // Seen changed (the usual case), or a read cut short, or (on a slow machine) at the
    // start: either way a refusal after the VM sent its userfaultfd.
    assert!(
        err.contains("changed while served")
            || err.contains("truncated")
            || err.contains("holds 0x0 bytes"),
        "{err}"
    );
    assert!(err.contains("killed the peer"), "{err}");
    assert_eq!(vm.wait_exit(10).signal(), Some(libc::SIGKILL));
}

/// Once every block is in, the server blocks: over 5 s it uses under 1% of a core.
#[test]
fn an_idle_server_blocks_instead_of_polling() {
    need_uffd!();
    let d = dir("idle");
    let mem = memory_file(&d, 16 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = once(
        &socket,
        &mem,
        &["--threads", "2", "--prefetch-threads", "2"],
    );
    let mut vm = Standin::new(&[16 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // Let the collapse to huge pages that starts REGAIN_SETTLE later end; then nothing is
    // left to do.
    wait_collapse_over(&vm);
    std::thread::sleep(Duration::from_millis(200));
    let (used, window) = cpu_over(srv.id(), Duration::from_secs(5));
    eprintln!(
        "idle server: {used} clock ticks of CPU in 5 s ({:.2}% of a core)",
        used as f64 * 100.0 / window as f64
    );
    assert!(
        used * 100 < window,
        "an idle server used {used} ticks of {window} in 5 s: more than 1% of a core"
    );
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("16 of 16 blocks in"), "{out}");
}

/// The socket appears only once it listens: a VMM that connects the moment the path
/// exists is never refused.
#[test]
fn the_socket_listens_once_its_path_appears() {
    need_uffd!();
    let d = dir("appears");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let srv = spawn(&[(&socket, &mem)], &["--once"]);
    let t = Instant::now();
    while !socket.exists() {
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::hint::spin_loop();
    }
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.connect(&socket)
        .expect("the socket listens as soon as its path exists");
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    vm.disconnect();
    let (code, _, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
}

/// A second server on a live socket is refused and the first keeps it; a server removes
/// the path on exit only while it still names its own socket; a path that is not a socket
/// is never replaced.
#[test]
fn a_socket_is_never_taken_from_another_server_or_replaced_if_not_a_socket() {
    need_uffd!();
    let d = dir("sockets");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let first = once(&socket, &mem, &["--accept-timeout-s", "10"]);
    let (code, _, err) = finish(spawn(&[(&socket, &mem)], &["--once"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("--socket {}", socket.display()))
            && err.contains("another server listens there"),
        "{err}"
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_ok(),
        "the first keeps it"
    );
    let other_path = d.join("other.sock");
    let _other = std::os::unix::net::UnixListener::bind(&other_path).unwrap();
    std::fs::rename(&other_path, &socket).unwrap();
    use std::os::unix::fs::MetadataExt;
    let ino = std::fs::metadata(&socket).unwrap().ino();
    let (code, _, err) = finish(first);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("no VM connected within 10.0 s"), "{err}");
    assert_eq!(
        std::fs::metadata(&socket).unwrap().ino(),
        ino,
        "not ours: left in place"
    );
    std::fs::remove_file(&socket).unwrap();
    std::fs::write(&socket, b"not a socket").unwrap();
    let (code, _, err) = finish(spawn(&[(&socket, &mem)], &["--once"]));
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("exists and is not a socket"), "{err}");
    assert_eq!(std::fs::read(&socket).unwrap(), b"not a socket");
}

/// `--record` is checked before the server listens (a missing directory, a symlink), and
/// written whole (no temporary left).
#[test]
fn record_is_checked_before_listening_and_written_whole() {
    need_uffd!();
    let d = dir("record");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let victim = d.join("victim");
    std::fs::write(&victim, b"keep").unwrap();
    let link = d.join("link.json");
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    for (record, says) in [
        (d.join("missing/ws.json"), "missing"),
        (link.clone(), "not a regular file"),
    ] {
        let (code, _, err) = finish(spawn(
            &[(&socket, &mem)],
            &["--once", "--record", record.to_str().unwrap()],
        ));
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(says) && err.contains("--record"), "{err}");
        assert!(
            !err.contains("listening on"),
            "refused before listening: {err}"
        );
        assert!(!socket.exists());
    }
    assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
    let record = d.join("ws.json");
    let srv = once(
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
}

/// A block size past the cap (each serving thread stages one block) is refused before the
/// server listens.
#[test]
fn a_block_past_the_cap_is_refused_before_listening() {
    let d = dir("block");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let (code, _, err) = finish(spawn(&[(&socket, &mem)], &["--once", "--block", "4G"]));
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("block size 0x100000000") && err.contains("0x4000000"),
        "{err}"
    );
    assert!(!socket.exists());
}
