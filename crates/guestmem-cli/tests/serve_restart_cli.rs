//! A page server's VMs outlive it: a `kill -9` loses no VM and no page (the next server
//! on the same state directory takes them back), two servers never share a state
//! directory, and a running server hands its sockets and VMs to a new one (an upgrade)
//! without downtime.

mod common;

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::*;

#[test]
fn a_kill_9_of_the_server_loses_no_vm_and_no_page() {
    need_uffd!();
    const SIZE: usize = 32 * MIB;
    let d = dir("kill9");
    let mem = memory_file(&d, SIZE, Some(9 * MIB));
    let socket = d.join("uffd.sock");
    let state = d.join("state");
    let args = restart_args(&state);
    let mut first = server(&[(&socket, &mem)], &args);
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
    let records = || {
        std::fs::read_dir(&state).map_or(0, |d| {
            d.filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_str().unwrap().starts_with("session-")
            })
            .count()
        })
    };
    let t = Instant::now();
    while records() < 2 {
        assert!(t.elapsed() < Duration::from_secs(10), "no session records");
        std::thread::sleep(Duration::from_millis(5));
    }
    let read = AtomicUsize::new(0);
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
                        read.fetch_add(1, Ordering::Relaxed);
                        if p % 64 == 0 {
                            // Guest work between touches: the kill lands mid-run.
                            std::thread::sleep(Duration::from_millis(2));
                        }
                    }
                    worst
                })
            })
            .collect();
        // Kill the server a quarter of the way in.
        let t = Instant::now();
        while read.load(Ordering::Relaxed) < SIZE / PAGE / 2 {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the VMs made no progress"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: kill on our own child's pid.
        assert_eq!(unsafe { libc::kill(first.id() as i32, libc::SIGKILL) }, 0);
        first.wait_exit(5);
        let at_kill = read.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            read.load(Ordering::Relaxed) < 2 * SIZE / PAGE,
            "the VMs are frozen without a server (read {at_kill} pages at the kill)"
        );
        // A new server on the same state takes both VMs back.
        let second = server(&[(&socket, &mem)], &args);
        let stalls = readers.into_iter().map(|r| r.join().unwrap()).collect();
        let (code, out, err, _) = terminate(second);
        assert_eq!(code, 0, "{err}");
        assert_eq!(err.matches("took back peer").count(), 2, "{err}");
        assert!(out.contains("2 VMs: 2 graduated"), "{out}");
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
fn a_second_server_on_the_same_state_dir_is_refused() {
    need_uffd!();
    let d = dir("state-lock");
    let mem = memory_file(&d, 4 * MIB, None);
    let state = d.join("state");
    let args = ["--state-dir", state.to_str().unwrap()];
    let (a, b) = (d.join("a.sock"), d.join("b.sock"));
    let first = server(&[(&a, &mem)], &args);
    // Two servers would both serve the VMs the records name.
    let (code, _, err) = finish(spawn(&[(&b, &mem)], &args));
    assert_ne!(code, 0);
    assert!(
        err.contains("--state-dir") && err.contains("another server holds it"),
        "{err}"
    );
    let (code, _, err, _) = terminate(first);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_server_hands_its_sockets_and_vms_to_a_new_server_without_downtime() {
    need_uffd!();
    hand_off("handoff", true, true);
}

/// The same without state directories: the pages the VM's balloon removed travel with it
/// (a memfd beside its userfaultfd).
#[test]
fn a_server_without_records_hands_its_vms_over_with_their_removed_pages() {
    need_uffd!();
    hand_off("handoff-no-state", false, false);
}

/// The same from a server without a state directory to one with: the new server keeps the
/// removed pages it was sent in its own record's file.
#[test]
fn a_server_without_records_hands_removed_pages_to_one_that_keeps_them() {
    need_uffd!();
    hand_off("handoff-to-state", false, true);
}

/// A hand-off of a VM half served, 4 pages of the rest removed by its balloon; with
/// `old_records` / `new_records`, that server keeps records (both in one directory).
fn hand_off(name: &str, old_records: bool, new_records: bool) {
    let records = old_records;
    const SIZE: usize = 16 * MIB;
    let d = dir(name);
    let mem = memory_file(&d, SIZE, Some(5 * MIB));
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let state = d.join("state");
    // With records, both servers keep them: the VMs handed over must not be taken back a
    // second time from the records the old server left. Faults alone, so that half the
    // memory is still to serve after the hand-off.
    let mut args = vec![
        "--control",
        control.to_str().unwrap(),
        "--on-failure",
        "leave",
        "--prefetch-threads",
        "0",
    ];
    let mut new_args = args.clone();
    if old_records {
        args.extend(["--state-dir", state.to_str().unwrap()]);
    }
    if new_records {
        new_args.extend(["--state-dir", state.to_str().unwrap()]);
    }
    let mut old = server(&[(&socket, &mem)], &args);
    wait_for(&control);
    let want = |at: usize| {
        if (5 * MIB..6 * MIB).contains(&at) {
            0
        } else {
            word(at as u64)
        }
    };
    let mut first = Standin::new(&[SIZE], true).unwrap();
    first.connect(&socket).unwrap();
    for p in 0..SIZE / 2 / PAGE {
        assert_eq!(first.word(p * PAGE), want(p * PAGE));
    }
    // Its balloon takes 4 pages not served yet: they stay removed with the new server.
    let removed = 12 * MIB..12 * MIB + 4 * PAGE;
    first.remove(removed.start, 4 * PAGE).unwrap();
    let t = Instant::now();
    while records && removed_kept(&state) < 4 {
        assert!(t.elapsed() < Duration::from_secs(10), "removes not kept");
        std::thread::sleep(Duration::from_millis(5));
    }
    let want_first = |at: usize| if removed.contains(&at) { 0 } else { want(at) };
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
    cmd.args(["serve-uffd", "--socket"])
        .arg(&socket)
        .arg("--mem-file")
        .arg(&mem)
        .arg("--take-over")
        .arg(&control)
        .args(&new_args);
    let mut new = Srv::start(&mut cmd);
    let status = old.wait_exit(20);
    assert_eq!(status.code(), Some(0), "the old server exits 0");
    let (out, _) = old.output();
    assert!(out.contains("1 handed off"), "{out}");
    assert!(
        socket.exists(),
        "the socket path stays through the hand-off"
    );
    std::thread::sleep(Duration::from_millis(200));
    if !new.running() {
        panic!("the new server exited: {}", new.output().1);
    }
    // The VM goes on: the rest of its memory comes from the new server.
    for p in SIZE / 2 / PAGE..SIZE / PAGE {
        assert_eq!(first.word(p * PAGE), want_first(p * PAGE), "page {p}");
    }
    if new_records {
        assert_eq!(removed_kept(&state), 4, "kept by the new server");
    }
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
    assert!(
        err.contains("4 pages its balloon removed before stay removed"),
        "{err}"
    );
    assert!(out.contains("2 VMs: 2 graduated"), "{out}\n{err}");
    for p in 0..SIZE / PAGE {
        assert_eq!(first.word(p * PAGE), want_first(p * PAGE));
        assert_eq!(second.word(p * PAGE), want(p * PAGE));
    }
}

/// A take-over the new server cannot serve gives nothing away: a new server started with
/// another memory file than the one its VM is served, or without the old server's state
/// directory, says which and exits 1, and the old server serves on (the VM reads the rest of its memory from it, and a VM that connects
/// after is served by it). The socket path stays. (Before, the hand-off had no
/// acknowledgement: the old server gave everything away and exited, and the new one ended
/// every VM it could not serve.)
#[test]
fn a_take_over_the_new_server_cannot_serve_leaves_every_vm_with_the_old_one() {
    need_uffd!();
    const SIZE: usize = 8 * MIB;
    let d = dir("handoff-kept");
    let mem = memory_file(&d, SIZE, None);
    let other = d.join("other");
    std::fs::copy(&mem, &other).unwrap();
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let state = d.join("state");
    let args = [
        "--control",
        control.to_str().unwrap(),
        "--prefetch-threads",
        "0",
        "--state-dir",
        state.to_str().unwrap(),
    ];
    let old = server(&[(&socket, &mem)], &args);
    wait_for(&control);
    let mut first = Standin::new(&[SIZE], false).unwrap();
    first.connect(&socket).unwrap();
    for p in 0..SIZE / 2 / PAGE {
        assert_eq!(first.word(p * PAGE), word((p * PAGE) as u64));
    }
    // Another memory file; then the right one, but no state directory (a server started
    // on the old one later would take the VMs back).
    let take_over = ["--take-over", control.to_str().unwrap()];
    let state_dir = ["--state-dir", state.to_str().unwrap()];
    for (file, extra, says) in [
        (
            &other,
            &state_dir[..],
            "is not among this server's memory files",
        ),
        (&mem, &[][..], "the old server keeps its records in"),
    ] {
        let (code, _, err) = finish(spawn(&[(&socket, file)], &[&take_over[..], extra].concat()));
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("--take-over")
                && err.contains(says)
                && err.contains("the old server serves its VMs on"),
            "{err}"
        );
    }
    assert!(socket.exists(), "the socket path stays");
    for p in SIZE / 2 / PAGE..SIZE / PAGE {
        assert_eq!(first.word(p * PAGE), word((p * PAGE) as u64), "page {p}");
    }
    let mut second = Standin::new(&[SIZE], false).unwrap();
    second.connect(&socket).unwrap();
    second.read_all(2);
    assert_eq!(second.compare(&mem).unwrap(), Ok(()));
    // Idle again once a collapse to huge pages has had its time: the hand-off asked for is
    // not seen again and again (it was, a core's worth, until its eventfd was read).
    wait_collapse_over(&second);
    wait_collapse_over(&first);
    std::thread::sleep(Duration::from_millis(200));
    let (used, window) = cpu_over(old.id(), Duration::from_secs(2));
    assert!(
        used * 10 < window,
        "the old server used {used} ticks of {window} in 2 s after a hand-off not taken"
    );
    let (code, out, err, _) = terminate(old);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("the new server did not take the hand-off"),
        "{err}"
    );
    assert!(out.contains("2 VMs: 2 graduated"), "{out}\n{err}");
}

/// A server given its socket as a path relative to its working directory hands it over
/// so that a new server elsewhere finds it: the new server, in another directory, names
/// it by its absolute path, takes it over, and serves the VM the old server served, every
/// page right. (Before, the relative path was sent as it was, the new server could not
/// find it, and the take-over was refused.)
#[test]
fn a_socket_given_relative_is_found_by_a_new_server_elsewhere() {
    need_uffd!();
    const SIZE: usize = 4 * MIB;
    let d = dir("handoff-relative");
    let mem = memory_file(&d, SIZE, None);
    let control = d.join("ctl.sock");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
    cmd.current_dir(d.as_ref() as &std::path::Path)
        .args(["serve-uffd", "--socket", "uffd.sock", "--mem-file"])
        .arg(&mem)
        .arg("--control")
        .arg(&control)
        .args(["--prefetch-threads", "0"]);
    let mut old = Srv::start(&mut cmd);
    let socket = d.join("uffd.sock");
    wait_for(&socket);
    wait_for(&control);
    let mut vm = Standin::new(&[SIZE], false).unwrap();
    vm.connect(&socket).unwrap();
    assert_eq!(vm.word(0), word(0));
    let mut new = Srv::start(
        Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .current_dir("/")
            .arg("serve-uffd")
            .arg("--socket")
            .arg(&socket)
            .arg("--mem-file")
            .arg(&mem)
            .arg("--take-over")
            .arg(&control),
    );
    let status = old.wait_exit(20);
    let (out, err) = old.output();
    assert_eq!(status.code(), Some(0), "{out}\n{err}");
    assert!(out.contains("1 handed off"), "{out}\n{err}");
    for p in 0..SIZE / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64), "page {p}");
    }
    assert!(new.running(), "{}", new.output().1);
    let (code, _, err, _) = terminate(new);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("took over 1 VMs"), "{err}");
}

/// Pages a VM's balloon removed stay removed across a `kill -9` of the server: the next
/// server reads them from the removed-pages file beside the VM's record and serves them as
/// zero, those of a block not yet in and those of a block in before the remove alike. Before,
/// it filled them with the snapshot's bytes (the balloon's memory back on the host).
#[test]
fn pages_a_balloon_removed_stay_removed_across_a_kill_9() {
    need_uffd!();
    const SIZE: usize = 16 * MIB;
    let d = dir("kill9-balloon");
    let mem = memory_file(&d, SIZE, None);
    let socket = d.join("uffd.sock");
    let state = d.join("state");
    let args = restart_args(&state);
    let mut first = server(&[(&socket, &mem)], &args);
    let mut vm = Standin::new(&[SIZE], true).unwrap();
    vm.connect(&socket).unwrap();
    // 16 pages of a block not read yet, and 2 of a block read before they went.
    let early = 3 * MIB + 5 * PAGE;
    vm.remove(early, 16 * PAGE).unwrap();
    let late = 8 * MIB + 7 * PAGE;
    assert_eq!(vm.word(late), word(late as u64));
    vm.remove(late, 2 * PAGE).unwrap();
    let removed = |at: usize| {
        (early..early + 16 * PAGE).contains(&at) || (late..late + 2 * PAGE).contains(&at)
    };
    // The server writes each remove's words just after it read the remove (what `madvise`
    // waits for): wait until the file holds all 18 pages.
    let t = Instant::now();
    while removed_kept(&state) < 18 {
        let kept = removed_kept(&state);
        assert!(t.elapsed() < Duration::from_secs(10), "{kept} pages kept");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(removed_kept(&state), 18);
    // SAFETY: kill on our own child's pid.
    assert_eq!(unsafe { libc::kill(first.id() as i32, libc::SIGKILL) }, 0);
    first.wait_exit(5);
    let second = server(&[(&socket, &mem)], &args);
    for p in 0..SIZE / PAGE {
        for at in [p * PAGE, p * PAGE + 4088] {
            let want = if removed(at) { 0 } else { word(at as u64) };
            assert_eq!(vm.word(at), want, "{at:#x}: removed {}", removed(at));
        }
    }
    vm.disconnect();
    let (code, _, err, _) = terminate(second);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("18 pages its balloon removed before stay removed"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(&state).unwrap().count(),
        0,
        "the record and its removed-pages file removed once the session ended"
    );
}

/// Pages marked removed in the removed-pages files of the state directory `state`.
fn removed_kept(state: &std::path::Path) -> u32 {
    std::fs::read_dir(state)
        .unwrap()
        .filter_map(|e| {
            let p = e.unwrap().path();
            (p.extension()? == "removed").then(|| std::fs::read(p).unwrap())
        })
        .map(|b| b.iter().map(|x| x.count_ones()).sum::<u32>())
        .sum()
}

/// A server's flags for a restart test on the state directory `state`: faults alone, so that
/// most of the memory is still to serve across the restart; the stand-ins (threads of this
/// process) left, not ended, on a failure.
fn restart_args(state: &std::path::Path) -> [&str; 8] {
    [
        "--threads",
        "2",
        "--prefetch-threads",
        "0",
        "--on-failure",
        "leave",
        "--state-dir",
        state.to_str().unwrap(),
    ]
}
