//! Files re-read when they change: certificates that cert-manager renews,
//! a policy or a JWKS that an operator edits, all without a restart.
//!
//! Each check reads the files whole and compares them with what was last
//! read: modification times are unreliable on Kubernetes' mounts, where an
//! update swaps a symlink to a new directory. The files are small. A
//! version that does not parse is reported once (log and metrics) and the
//! last good one stays in force until a later version parses.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use arc_swap::ArcSwap;

use crate::metrics;

/// A file that could not be used, named with the reason.
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct FileError {
    pub path: PathBuf,
    pub reason: String,
}

impl FileError {
    pub fn new(path: &Path, reason: impl Into<String>) -> Self {
        Self {
            path: path.to_owned(),
            reason: reason.into(),
        }
    }
}

/// Turns the contents of the watched files (in the order given) into a value.
pub type Parse<T> = fn(&[Vec<u8>], &[PathBuf]) -> Result<T, FileError>;

/// A value built from one or more files, swapped atomically when they change.
pub struct Watched<T> {
    /// What the metrics and logs call it: `tls`, `policy`, `jwks`, `static_tokens`.
    kind: &'static str,
    paths: Vec<PathBuf>,
    parse: Parse<T>,
    current: ArcSwap<T>,
    /// The contents last read, parsed or not: a broken version is reported
    /// once, not at every check.
    seen: Mutex<Vec<Vec<u8>>>,
}

impl<T> std::fmt::Debug for Watched<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("kind", &self.kind)
            .field("paths", &self.paths)
            .finish_non_exhaustive()
    }
}

fn read_all(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, FileError> {
    paths
        .iter()
        .map(|path| std::fs::read(path).map_err(|error| FileError::new(path, error.to_string())))
        .collect()
}

impl<T> Watched<T> {
    /// Reads and parses the files now: at start a broken file stops the
    /// server, with the file (and, where the parser knows it, the line) named.
    pub fn load(
        kind: &'static str,
        paths: Vec<PathBuf>,
        parse: Parse<T>,
    ) -> Result<Self, FileError> {
        let contents = read_all(&paths)?;
        let value = parse(&contents, &paths)?;
        metrics::config_file_loaded(kind, true);
        Ok(Self {
            kind,
            paths,
            parse,
            current: ArcSwap::from_pointee(value),
            seen: Mutex::new(contents),
        })
    }

    /// The value in force.
    pub fn current(&self) -> Arc<T> {
        self.current.load_full()
    }

    /// Reads the files again; swaps the value in when they changed and parse.
    /// `true` when a new value is in force.
    pub fn refresh(&self) -> bool {
        let contents = match read_all(&self.paths) {
            Ok(contents) => contents,
            Err(error) => {
                // A file briefly missing mid-swap is read again at the next
                // check, and parsed then even if unchanged, so that the
                // gauge says whether the version in force is on disk.
                tracing::warn!(kind = self.kind, %error, "cannot read a watched file; keeping the version in force");
                metrics::config_file_loaded(self.kind, false);
                self.seen.lock().expect("not poisoned").clear();
                return false;
            }
        };
        let mut seen = self.seen.lock().expect("not poisoned");
        if *seen == contents {
            return false;
        }
        let result = (self.parse)(&contents, &self.paths);
        *seen = contents;
        drop(seen);
        match result {
            Ok(value) => {
                self.current.store(Arc::new(value));
                metrics::config_reloaded(self.kind, true);
                tracing::info!(kind = self.kind, files = ?self.paths, "reloaded");
                true
            }
            Err(error) => {
                metrics::config_reloaded(self.kind, false);
                tracing::error!(kind = self.kind, %error, "the changed file is invalid; keeping the last good version");
                false
            }
        }
    }
}

/// A TOML file's error as people read it: `line N: what is wrong`.
pub fn toml_error(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim().to_owned();
    match error.span() {
        Some(span) => format!("line {}: {message}", line_of(text, span.start)),
        None => message,
    }
}

/// Parses the one text file of `paths` with `parse`, naming the file in errors.
pub fn parse_text<T>(
    contents: &[Vec<u8>],
    paths: &[PathBuf],
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, FileError> {
    let text = std::str::from_utf8(&contents[0])
        .map_err(|_| FileError::new(&paths[0], "not UTF-8 text"))?;
    parse(text).map_err(|why| FileError::new(&paths[0], why))
}

/// 1-based line of a byte offset, for errors in files people edit.
pub fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset).unwrap_or(text).matches('\n').count() + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_number(contents: &[Vec<u8>], paths: &[PathBuf]) -> Result<u32, FileError> {
        let text = String::from_utf8_lossy(&contents[0]);
        text.trim()
            .parse()
            .map_err(|_| FileError::new(&paths[0], "not a number"))
    }

    #[test]
    fn a_changed_file_is_swapped_in_and_a_broken_one_keeps_the_last_good() {
        let dir = std::env::temp_dir().join(format!("watch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("n");
        std::fs::write(&path, "1").unwrap();
        let watched = Watched::load("test", vec![path.clone()], parse_number).unwrap();
        assert_eq!(*watched.current(), 1);
        assert!(!watched.refresh(), "unchanged");
        std::fs::write(&path, "2").unwrap();
        assert!(watched.refresh());
        assert_eq!(*watched.current(), 2);
        std::fs::write(&path, "two").unwrap();
        assert!(!watched.refresh());
        assert_eq!(*watched.current(), 2, "the last good version stays");
        std::fs::remove_file(&path).unwrap();
        assert!(!watched.refresh());
        assert_eq!(*watched.current(), 2);
        std::fs::write(&path, "3").unwrap();
        assert!(watched.refresh());
        assert_eq!(*watched.current(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_broken_file_at_start_is_an_error_naming_it() {
        let path = std::env::temp_dir().join(format!("watch-missing-{}", std::process::id()));
        let error = Watched::load("test", vec![path.clone()], parse_number).unwrap_err();
        assert!(
            error.to_string().contains(&*path.to_string_lossy()),
            "{error}"
        );
    }

    #[test]
    fn lines_count_from_one() {
        assert_eq!(line_of("a\nb\nc", 0), 1);
        assert_eq!(line_of("a\nb\nc", 2), 2);
        assert_eq!(line_of("a\nb\nc", 4), 3);
    }
}
