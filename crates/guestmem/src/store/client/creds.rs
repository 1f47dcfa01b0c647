//! Credentials taken from the profile files are read again when the files change, and the
//! strings never to let out follow them.
//!
//! A session token from a profile expires (an hour, often less); a credential helper (an
//! SSO login, a sidecar, a cron job) writes the next one into the credentials file before
//! then. A page server runs for weeks: with the credentials read once, every GET after the
//! expiry was refused and each VM still faulting was ended. The AWS SDKs re-read too. Keys
//! from the environment stay as they are: a process's environment does not change.
//! object_store's instance-metadata and web-identity providers, used when neither the
//! environment nor the profile has a key, refresh themselves.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use object_store::aws::AwsCredential;
use object_store::CredentialProvider;

use crate::store::profile::ProfileFiles;

/// How often the files are read again, at most: every request asks. (Read, not `stat`ed:
/// a rewrite in place of the same length may keep its change time on a kernel with coarse
/// timestamps; the files are small.)
pub(super) const RECHECK: Duration = Duration::from_secs(1);
/// Credential sets kept for redaction after they were replaced: an error from a request
/// signed before a change may be told after it. Bounded: a server that runs for a year
/// sees thousands of rotations.
const KEPT_SETS: usize = 4;
/// Shorter strings are not redacted (they would blank out ordinary words).
const MIN_SECRET: usize = 4;

/// The strings never to let out: the endpoint's user and password for the client's life,
/// and the last few credential sets.
#[derive(Default)]
pub(super) struct Secrets {
    fixed: Vec<String>,
    sets: RwLock<VecDeque<Vec<String>>>,
}

impl Secrets {
    /// `fixed` kept for ever, `set` as the first credential set.
    pub(super) fn new(fixed: Vec<String>, set: Vec<String>) -> Secrets {
        let s = Secrets {
            fixed: fixed
                .into_iter()
                .filter(|s| s.len() >= MIN_SECRET)
                .collect(),
            sets: RwLock::default(),
        };
        s.add(set);
        s
    }

    /// A new credential set; the oldest past [`KEPT_SETS`] is let go.
    pub(super) fn add(&self, set: Vec<String>) {
        let set: Vec<String> = set.into_iter().filter(|s| s.len() >= MIN_SECRET).collect();
        if set.is_empty() {
            return;
        }
        let mut sets = self.sets.write().unwrap_or_else(PoisonError::into_inner);
        sets.push_back(set);
        while sets.len() > KEPT_SETS + 1 {
            sets.pop_front();
        }
    }

    /// `s` with every secret in it replaced by `[redacted]`.
    pub(super) fn redact(&self, mut s: String) -> String {
        let sets = self.sets.read().unwrap_or_else(PoisonError::into_inner);
        for k in self.fixed.iter().chain(sets.iter().flatten()) {
            if s.contains(k.as_str()) {
                s = s.replace(k.as_str(), "[redacted]");
            }
        }
        s
    }
}

/// The strings of a credential set that must not be shown.
pub(super) fn secret_strings(c: &AwsCredential) -> Vec<String> {
    [Some(&c.key_id), Some(&c.secret_key), c.token.as_ref()]
        .into_iter()
        .flatten()
        .cloned()
        .collect()
}

/// A profile's credentials, read again once its files change.
pub(super) struct FromProfile {
    files: ProfileFiles,
    secrets: Arc<Secrets>,
    state: Mutex<State>,
}

struct State {
    cred: Arc<AwsCredential>,
    /// When the files were last read.
    checked: Instant,
    /// Whether what they held then had no key and secret (warned once a change).
    lacking: bool,
}

impl std::fmt::Debug for FromProfile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FromProfile").finish_non_exhaustive()
    }
}

impl FromProfile {
    /// `cred`, just read from `files`.
    pub(super) fn new(
        files: ProfileFiles,
        cred: AwsCredential,
        secrets: Arc<Secrets>,
    ) -> FromProfile {
        FromProfile {
            files,
            secrets,
            state: Mutex::new(State {
                cred: Arc::new(cred),
                checked: Instant::now(),
                lacking: false,
            }),
        }
    }

    /// Looks at the files before the next request (the store refused these credentials).
    pub(super) fn look_again(&self) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        st.checked = Instant::now().checked_sub(RECHECK).unwrap_or(st.checked);
    }

    /// The credentials to sign with now.
    pub(super) fn current(&self) -> Arc<AwsCredential> {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if st.checked.elapsed() < RECHECK {
            return Arc::clone(&st.cred);
        }
        st.checked = Instant::now();
        let p = self.files.read();
        match (p.access_key_id, p.secret_access_key) {
            (Some(key_id), Some(secret_key)) => {
                let cred = AwsCredential {
                    key_id,
                    secret_key,
                    token: p.session_token,
                };
                st.lacking = false;
                if cred != *st.cred {
                    // Known secrets first: no request is signed with one not yet redacted.
                    self.secrets.add(secret_strings(&cred));
                    st.cred = Arc::new(cred);
                    tracing::info!(
                        "the profile's credentials changed; requests are signed with the new ones"
                    );
                }
            }
            _ if st.lacking => {}
            _ => {
                // Once, until they hold both again (a helper between writes, or gone).
                st.lacking = true;
                tracing::warn!(
                    "the profile files no longer hold both a key id and a secret key; \
                     requests are signed with the credentials read before"
                );
            }
        }
        Arc::clone(&st.cred)
    }
}

#[async_trait::async_trait]
impl CredentialProvider for FromProfile {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        Ok(self.current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_last_sets_are_kept_and_every_kept_one_is_redacted() {
        let s = Secrets::new(vec!["pass".into(), "ab".into()], vec!["key-0".into()]);
        for i in 1..=10 {
            s.add(vec![format!("key-{i}"), format!("secret-{i}")]);
        }
        let shown = s.redact("pass ab key-0 key-5 key-6 secret-10".into());
        assert_eq!(shown, "[redacted] ab key-0 key-5 [redacted] [redacted]");
        assert_eq!(s.sets.read().unwrap().len(), KEPT_SETS + 1);
    }
}
