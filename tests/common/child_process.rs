//! Running a scenario in a child process with a watchdog: scenarios that hung, aborted or
//! broke process-wide state before their fix run there, so a hang or an abort fails the test
//! instead of the whole test binary.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `scenario` in a child process (this test binary, filtered to the test `name`), and
/// fails unless it exits successfully within `limit`. In the child, runs it directly.
///
/// `name` is the test's full path in its binary (`module::test`): the child runs the binary
/// with `name --exact`, and fails with "the child did not run the scenario" if nothing matched.
pub(crate) fn isolated(name: &str, limit: Duration, scenario: fn()) {
    const CHILD: &str = "ABL_RELIABILITY_CHILD";
    if std::env::var(CHILD).as_deref() == Ok(name) {
        scenario();
        return;
    }
    let mut child = Command::new(std::env::current_exe().expect("the test binary"))
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, name)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child test process");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break Some(status);
        }
        if started.elapsed() > limit {
            child.kill().expect("kill the hung child");
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let output = child.wait_with_output().expect("the child's output");
    let text = format!(
        "--- child stdout ---\n{}\n--- child stderr ---\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    match status {
        None => panic!("{name}: the scenario hung (killed after {limit:?})\n{text}"),
        Some(status) => assert!(
            status.success(),
            "{name}: the scenario failed or aborted ({status})\n{text}"
        ),
    }
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("1 passed"),
        "{name}: the child did not run the scenario\n{text}"
    );
}
