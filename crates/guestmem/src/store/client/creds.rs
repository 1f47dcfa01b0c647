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
/// A refusal has the files read again at once, but not more often than this.
pub(super) const FORCED_GAP: Duration = Duration::from_millis(100);

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

    /// `s` with every secret in it replaced by `[redacted]`, longest first (a string that
    /// is part of another, a cut read of a token say, must not leave the rest of it), and
    /// what a store's error echoes of a request's credentials left out whatever they were
    /// (those of providers that fetch their own are never known here).
    pub(super) fn redact(&self, s: String) -> String {
        let mut s = strip_echoes(s);
        let sets = self.sets.read().unwrap_or_else(PoisonError::into_inner);
        let mut all: Vec<&String> = self.fixed.iter().chain(sets.iter().flatten()).collect();
        all.sort_by_key(|k| std::cmp::Reverse(k.len()));
        for k in all {
            if s.contains(k.as_str()) {
                s = s.replace(k.as_str(), "[redacted]");
            }
        }
        s
    }
}

/// Elements of an S3 error's body that echo a request's credentials or its signed form:
/// the session token, the key id, the canonical request (which holds the token) and the
/// string signed, as text and as hex.
const ECHOES: [&str; 6] = [
    "Token-0",
    "AWSAccessKeyId",
    "CanonicalRequest",
    "CanonicalRequestBytes",
    "StringToSign",
    "StringToSignBytes",
];

/// `s` with the content of every [`ECHOES`] element replaced by `[redacted]`.
fn strip_echoes(mut s: String) -> String {
    for name in ECHOES {
        let (open, close) = (format!("<{name}>"), format!("</{name}>"));
        let mut from = 0;
        while let Some(i) = s[from..].find(&open).map(|i| from + i + open.len()) {
            // An element cut off (a body shortened for the message) is left out to the end.
            let end = s[i..].find(&close).map_or(s.len(), |j| i + j);
            s.replace_range(i..end, "[redacted]");
            from = i + "[redacted]".len();
        }
    }
    s
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
    /// The store refused the credentials since: read again from [`FORCED_GAP`] after the
    /// last read.
    refused: bool,
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
                refused: false,
            }),
        }
    }

    /// Reads the files before the next request (the store refused these credentials), or
    /// [`FORCED_GAP`] after the last read: a burst of refusals costs one read.
    pub(super) fn look_again(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .refused = true;
    }

    /// The credentials to sign with now.
    pub(super) fn current(&self) -> Arc<AwsCredential> {
        let held = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let since = st.checked.elapsed();
            if since < RECHECK && !(st.refused && since >= FORCED_GAP) {
                return Arc::clone(&st.cred);
            }
            st.refused = false;
            // This caller reads; the others sign with what is held meanwhile. The lock is
            // not held over the read (a file system that hangs would hold every request).
            st.checked = Instant::now();
            Arc::clone(&st.cred)
        };
        let p = self.files.read();
        let read = match (p.access_key_id, p.secret_access_key) {
            (Some(key_id), Some(secret_key)) => Some(AwsCredential {
                key_id,
                secret_key,
                token: p.session_token,
            })
            .filter(usable),
            _ => None,
        };
        let mut said = None;
        let cred = {
            let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match read {
                Some(cred) => {
                    st.lacking = false;
                    // Another reader may have swapped in the meantime: compared with what
                    // is held now.
                    if cred != *st.cred && cred != *held {
                        // Known secrets first: no request is signed with one not redacted.
                        self.secrets.add(secret_strings(&cred));
                        st.cred = Arc::new(cred);
                        said = Some(true);
                    }
                }
                None if st.lacking => {}
                None => {
                    // Once, until they hold a usable set again.
                    st.lacking = true;
                    said = Some(false);
                }
            }
            Arc::clone(&st.cred)
        };
        match said {
            Some(true) => {
                tracing::info!(
                    "the profile's credentials changed; requests are signed with the new ones"
                )
            }
            Some(false) => tracing::warn!(
                "the profile files no longer hold a usable key id and secret key (missing, or \
                 a byte a request header cannot carry: a file being written?); requests are \
                 signed with the credentials read before"
            ),
            None => {}
        }
        cred
    }
}

/// Whether a set can sign requests: each string visible ASCII (no space, no control
/// byte: object_store puts them in headers, and panics on a byte a header cannot carry),
/// and not empty. A file read while a helper writes it may hold a NUL or a cut string.
pub(super) fn usable(c: &AwsCredential) -> bool {
    let ok = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_graphic());
    ok(&c.key_id) && ok(&c.secret_key) && c.token.as_deref().is_none_or(ok)
}

/// Codes a store gives a request it refuses for its credentials (not for a policy): they
/// may pass once the profile's next set is read. AWS answers an expired session token with
/// 400 `ExpiredToken`, a key it does not know with 403 `InvalidAccessKeyId`.
pub(super) fn refused_for_credentials(error_text: &str) -> bool {
    [
        "<Code>ExpiredToken</Code>",
        "<Code>InvalidToken</Code>",
        "<Code>TokenRefreshRequired</Code>",
        "<Code>InvalidAccessKeyId</Code>",
        "<Code>SignatureDoesNotMatch</Code>",
    ]
    .iter()
    .any(|c| error_text.contains(c))
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
    fn what_a_stores_error_echoes_of_a_request_is_left_out() {
        let s = Secrets::new(Vec::new(), vec!["tok-0123456789".into(), "tok-0123".into()]);
        let body = "400: <Error><Code>ExpiredToken</Code><Token-0>FQoGZX+/=</Token-0>\
                    <CanonicalRequest>GET\nx-amz-security-token:abc</CanonicalRequest>\
                    <CanonicalRequestBytes>47 45 54</CanonicalRequestBytes>\
                    <AWSAccessKeyId>ASIAX</AWSAccessKeyId></Error> tok-0123456789 \
                    <StringToSign>cut off";
        let shown = s.redact(body.into());
        for secret in [
            "FQoGZX",
            "x-amz-security-token",
            "47 45 54",
            "ASIAX",
            "cut off",
            "6789",
        ] {
            assert!(!shown.contains(secret), "{secret}: {shown}");
        }
        assert!(shown.contains("<Code>ExpiredToken</Code>"), "{shown}");
    }

    #[test]
    fn a_set_a_header_cannot_carry_is_not_used() {
        let c = |k: &str, s: &str, t: Option<&str>| AwsCredential {
            key_id: k.into(),
            secret_key: s.into(),
            token: t.map(String::from),
        };
        assert!(usable(&c("AKID", "a/b+c=", Some("FQo+/="))));
        assert!(!usable(&c("AKID", "sec\0\0", None)));
        assert!(!usable(&c("AKID", "", None)));
        assert!(!usable(&c("AK ID", "s", None)));
        assert!(!usable(&c("AKID", "s", Some("t\u{7f}"))));
        assert!(!usable(&c("AKID", "s", Some("tök"))));
    }

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
