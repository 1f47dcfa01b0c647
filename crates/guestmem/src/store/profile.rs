//! The AWS shared configuration and credentials files (`~/.aws/config`,
//! `~/.aws/credentials`), read for the profile `AWS_PROFILE` names (else `default`), as every
//! AWS SDK reads them. object_store reads only the environment, hence this small reader: the
//! files are INI, and only five keys matter here.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// What a profile says, each key as the files spell it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Profile {
    pub(crate) access_key_id: Option<String>,
    pub(crate) secret_access_key: Option<String>,
    pub(crate) session_token: Option<String>,
    pub(crate) region: Option<String>,
    pub(crate) endpoint_url: Option<String>,
}

/// Largest profile file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Where a profile is read from: its name and the two files, as the environment said when
/// the client was made (a process's environment does not change; the files may: a
/// credential helper rewrites them before a session token expires).
#[derive(Debug, Clone)]
pub(crate) struct ProfileFiles {
    name: String,
    config: Option<PathBuf>,
    credentials: Option<PathBuf>,
}

impl ProfileFiles {
    /// The profile `AWS_PROFILE` (or `default`) in the files `AWS_CONFIG_FILE` and
    /// `AWS_SHARED_CREDENTIALS_FILE` name (else under `$HOME/.aws`).
    pub(crate) fn locate(env: &dyn Fn(&str) -> Option<String>) -> ProfileFiles {
        let name = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let home = env("HOME").map(PathBuf::from);
        let at = |var: &str, file: &str| {
            env(var)
                .map(PathBuf::from)
                .or_else(|| home.as_ref().map(|h| h.join(".aws").join(file)))
        };
        ProfileFiles {
            name,
            config: at("AWS_CONFIG_FILE", "config"),
            credentials: at("AWS_SHARED_CREDENTIALS_FILE", "credentials"),
        }
    }

    /// What the files say now; the credentials file wins where both say. Files that are not
    /// there say nothing.
    pub(crate) fn read(&self) -> Profile {
        let mut p = Profile::default();
        // In the config file a profile other than default is `[profile NAME]`.
        let config_section = if self.name == "default" {
            "default".to_string()
        } else {
            format!("profile {}", self.name)
        };
        if let Some(text) = self.config.clone().and_then(read) {
            p.apply(&parse_ini(&text), &config_section);
        }
        if let Some(text) = self.credentials.clone().and_then(read) {
            p.apply(&parse_ini(&text), &self.name);
        }
        p
    }
}

impl Profile {
    /// [`ProfileFiles::locate`] and [`ProfileFiles::read`] at once.
    #[cfg(test)]
    pub(crate) fn from_files(env: &dyn Fn(&str) -> Option<String>) -> Profile {
        ProfileFiles::locate(env).read()
    }

    fn apply(&mut self, ini: &BTreeMap<String, BTreeMap<String, String>>, section: &str) {
        let Some(s) = ini.get(section) else { return };
        let set = |slot: &mut Option<String>, key: &str| {
            if let Some(v) = s.get(key).filter(|v| !v.is_empty()) {
                *slot = Some(v.clone());
            }
        };
        set(&mut self.access_key_id, "aws_access_key_id");
        set(&mut self.secret_access_key, "aws_secret_access_key");
        set(&mut self.session_token, "aws_session_token");
        set(&mut self.region, "region");
        set(&mut self.endpoint_url, "endpoint_url");
    }
}

fn read(path: PathBuf) -> Option<String> {
    use std::io::Read;
    let f = std::fs::File::open(path).ok()?;
    let mut s = String::new();
    f.take(MAX_FILE_BYTES).read_to_string(&mut s).ok()?;
    Some(s)
}

/// `[section]` then `key = value` lines; `#` and `;` start comments; keys lowercased.
fn parse_ini(text: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let mut section: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = Some(name.trim().to_string());
            continue;
        }
        if let (Some(s), Some((k, v))) = (&section, line.split_once('=')) {
            out.entry(s.clone())
                .or_default()
                .insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_is_read_from_both_files_the_credentials_file_winning() {
        let scratch = guestmem_testkit::Scratch::new("profile");
        let dir = scratch.to_path_buf();
        std::fs::write(
            dir.join("config"),
            "[default]\nregion = eu-west-1\n[profile lab]\nregion = us-east-2\nendpoint_url = http://127.0.0.1:9000\naws_access_key_id = fromconfig\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("credentials"),
            "# comment\n[lab]\naws_access_key_id = AKID\naws_secret_access_key = s3cr3t\n",
        )
        .unwrap();
        let d = dir.clone();
        let env = move |k: &str| match k {
            "AWS_PROFILE" => Some("lab".to_string()),
            "AWS_CONFIG_FILE" => Some(d.join("config").display().to_string()),
            "AWS_SHARED_CREDENTIALS_FILE" => Some(d.join("credentials").display().to_string()),
            _ => None,
        };
        let p = Profile::from_files(&env);
        assert_eq!(p.access_key_id.as_deref(), Some("AKID"));
        assert_eq!(p.secret_access_key.as_deref(), Some("s3cr3t"));
        assert_eq!(p.region.as_deref(), Some("us-east-2"));
        assert_eq!(p.endpoint_url.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(p.session_token, None);
    }
}
