//! A lab run stopped by a signal removes its scratch folder (gigabytes for an object-store
//! run) and ends by the signal, as it would without the clean-up.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

use guestmem_testkit::{ChildGuard, Scratch};

#[test]
fn a_run_stopped_by_sigterm_removes_its_scratch_folder() {
    let tmp = Scratch::new("lab-stop");
    let out = tmp.join("out");
    let mut lab = ChildGuard::new(
        Command::new(env!("CARGO_BIN_EXE_guestmem-lab"))
            .env("TMPDIR", &*tmp)
            .args([
                "object-store",
                "--size",
                "256M",
                "--rounds",
                "1",
                "--warmup",
                "0",
            ])
            .arg("--out")
            .arg(&out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Read beside the run: a full pipe would hold it up.
    let mut stderr = lab.child().stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut err);
        err
    });
    let work = tmp.join(format!("guestmem-lab-object-store-{}", lab.id()));
    // Its S3 server's folder is made once the memory file is written: the run is under way.
    let store = work.join(format!("gm-s3-{}-lab-object-store", lab.id()));
    let t = Instant::now();
    while !store.exists() {
        assert!(lab.running(), "the run ended before its S3 server started");
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "no {}",
            store.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill(2) with the pid of a child this test holds unreaped.
    let sent = unsafe { libc::kill(lab.id() as libc::pid_t, libc::SIGTERM) };
    assert_eq!(sent, 0);
    let status = lab.wait_exit(30);
    let err = reader.join().unwrap();
    // Ended by the signal itself, as without the clean-up (a shell's loop then stops).
    assert_eq!(status.signal(), Some(libc::SIGTERM), "{status:?}: {err}");
    assert!(err.contains("stopped by signal 15"), "{err}");
    // Nothing of the run's is left (its S3 server's folder was in its scratch folder): at
    // once, or once the clean-up that waits for the run's end has removed what its threads
    // made meanwhile.
    let left = || -> Vec<std::ffi::OsString> {
        std::fs::read_dir(&*tmp)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| *n != "out")
            .collect()
    };
    let t = Instant::now();
    while !left().is_empty() && t.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        left().is_empty(),
        "left behind in {}: {:?}: {err}",
        tmp.display(),
        left()
    );
}
