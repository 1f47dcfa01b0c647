//! `kill_guarded_children`: every child a guard holds is killed at once, without its guard
//! dropping (a process stopped by a signal), and one guarded after it too. A test binary of
//! its own: it kills every guarded child of its process, for good.

use std::os::unix::process::ExitStatusExt;
use std::process::Command;

use guestmem_testkit::{kill_guarded_children, ChildGuard};

#[test]
fn every_guarded_child_is_killed_at_once() {
    let sleeper = || ChildGuard::new(Command::new("sleep").arg("60").spawn().unwrap());
    let (mut a, mut b) = (sleeper(), sleeper());
    let mut gone = sleeper();
    gone.kill();
    drop(gone);
    kill_guarded_children();
    // One guarded after (a thread of the process was starting it): killed at once.
    let mut late = sleeper();
    for c in [&mut a, &mut b, &mut late] {
        let status = c.wait_exit(10);
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }
}
