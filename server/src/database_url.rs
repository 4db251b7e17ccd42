//! The database URL: checked before sqlx reads it, and shown in logs without
//! its password, whatever characters the password holds.
//!
//! A URL can be read in two ways when its password holds a character that
//! should have been percent-encoded. sqlx (through the url crate) ends the
//! host part at the first `/`, `?` or `#` after `://`; the URL's author
//! meant everything up to the last `@` as user and password. To sqlx,
//! `postgres://idem:p@ss/w0rd@db/x` is host `ss` and database `w0rd@db/x`,
//! so it cannot connect as meant, and its errors would quote a part of the
//! password. Such a URL (one with an `@` after its host part ends) is refused
//! with a message that quotes none of it; a log line shows a fixed
//! placeholder instead. Every other URL reads the same both ways, so the
//! user, host, path and query shown are the ones sqlx uses, and the password
//! (all of the user information after its first `:`) is never shown.

use std::{
    borrow::Cow,
    fmt,
    path::{Path, PathBuf},
    str::FromStr,
};

use sqlx::postgres::PgConnectOptions;

/// What a log shows of a URL that the url crate cannot parse or that is not
/// a Postgres URL.
pub const NOT_SHOWN_INVALID: &str = "<database url not shown: not a valid postgres:// URL>";
/// What a log shows of a URL that sqlx would read differently from its
/// author (an unencoded `/`, `?` or `#` before the last `@`).
pub const NOT_SHOWN_AMBIGUOUS: &str =
    "<database url not shown: an '@' after its host (percent-encode the password)>";

/// The query parameters sqlx 0.9 reads (sqlx-postgres, `options/parse.rs`),
/// besides `password` and `options[NAME]`. It ignores any other with a
/// warning that quotes its name and value, which is how a password holding
/// an unencoded `&` (`password=ab&cd`) would reach a log: such parameters are
/// dropped before sqlx reads the URL.
const READ_BY_SQLX: &[&str] = &[
    "sslmode",
    "ssl-mode",
    "sslrootcert",
    "ssl-root-cert",
    "ssl-ca",
    "sslcert",
    "ssl-cert",
    "sslkey",
    "ssl-key",
    "statement-cache-capacity",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "application_name",
    "options",
];

/// A database URL whose password never reaches a log or `Debug` output.
#[derive(Clone)]
pub struct DatabaseUrl(String);

/// Why a database URL cannot be used. No variant holds any part of the URL
/// or of the file it came from.
#[derive(Debug, thiserror::Error)]
pub enum DatabaseUrlError {
    #[error("reading the database URL from the file {}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the database URL file {} is empty", path.display())]
    Empty { path: PathBuf },
    #[error(
        "no database URL: set --database-url (DATABASE_URL) or --database-url-file (DATABASE_URL_FILE)"
    )]
    Missing,
    #[error(
        "both --database-url (DATABASE_URL) and --database-url-file (DATABASE_URL_FILE) are set; set one"
    )]
    Both,
    #[error("the database URL must start with postgres:// or postgresql://")]
    NotPostgres,
    #[error(
        "the database URL has an '@' after its host part, so it would be read with another host \
         than meant: percent-encode the user name and password ('/' as %2F, '?' as %3F, \
         '#' as %23, '@' as %40), and any '@' in the path or query as %40"
    )]
    Ambiguous,
    #[error(
        "the database URL has a query parameter named like a password that is not `password`, \
         the only one read (the parameter is not named here: it may hold a password)"
    )]
    PasswordLikeParameter,
    #[error("the database URL is not valid")]
    Invalid(#[source] sqlx::Error),
}

impl DatabaseUrl {
    /// Reads the URL from a file (a mounted secret), ignoring trailing
    /// whitespace. Errors name the file, never its content.
    pub fn from_file(path: &Path) -> Result<Self, DatabaseUrlError> {
        let text = std::fs::read_to_string(path).map_err(|source| DatabaseUrlError::Read {
            path: path.to_owned(),
            source,
        })?;
        let url = text.trim_end();
        if url.is_empty() {
            return Err(DatabaseUrlError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Self(url.to_owned()))
    }

    pub fn expose(&self) -> &str {
        &self.0
    }

    /// The connect options sqlx reads from the URL, once the URL is known to
    /// read the same to sqlx as to its author. Query parameters sqlx does not
    /// read are dropped (sqlx would ignore them too, but log their values).
    pub fn connect_options(&self) -> Result<PgConnectOptions, DatabaseUrlError> {
        let text = normalized(&self.0);
        let parts = Parts::split(&text)?;
        let mut url = format!("{}://{}{}", parts.scheme, parts.authority, parts.path);
        if let Some(query) = parts.query {
            let mut kept = Vec::new();
            let mut ignored = 0usize;
            for (segment, key) in params(query) {
                if key != "password" && looks_like_password(&key) {
                    return Err(DatabaseUrlError::PasswordLikeParameter);
                }
                if key == "password" || read_by_sqlx(&key) {
                    kept.push(segment);
                } else {
                    ignored += 1;
                }
            }
            if ignored > 0 {
                tracing::warn!(
                    ignored,
                    "ignoring query parameters of the database URL that sqlx does not read \
                     (not named: a password's unencoded '&' would make part of it one)"
                );
            }
            if !kept.is_empty() {
                url.push('?');
                url.push_str(&kept.join("&"));
            }
        }
        url.parse().map_err(DatabaseUrlError::Invalid)
    }

    /// The URL for logs: the user, host, port, path and the query parameters
    /// sqlx reads, with `***` for the password wherever it is; a fixed
    /// placeholder when the URL is not valid or reads two ways.
    pub fn redacted(&self) -> String {
        let text = normalized(&self.0);
        let parts = match Parts::split(&text) {
            Ok(parts) => parts,
            Err(DatabaseUrlError::Ambiguous) => return NOT_SHOWN_AMBIGUOUS.to_owned(),
            Err(_) => return NOT_SHOWN_INVALID.to_owned(),
        };
        if url::Url::parse(&text).is_err() {
            return NOT_SHOWN_INVALID.to_owned();
        }
        let (user, host) = parts.user_and_host();
        let mut shown = format!("{}://", parts.scheme.to_ascii_lowercase());
        if let Some((user, has_password)) = user {
            shown.push_str(user);
            if has_password {
                shown.push_str(":***");
            }
            shown.push('@');
        }
        shown.push_str(host);
        shown.push_str(parts.path);
        if let Some(query) = parts.query {
            let mut kept = Vec::new();
            for (segment, key) in params(query) {
                // Nothing after a password is shown: an unencoded '&' in it
                // would start another parameter with the rest.
                if key == "password" {
                    kept.push("password=***");
                    break;
                }
                if looks_like_password(&key) {
                    break;
                }
                if read_by_sqlx(&key) {
                    kept.push(segment);
                }
            }
            if !kept.is_empty() {
                shown.push('?');
                shown.push_str(&kept.join("&"));
            }
        }
        shown
    }
}

impl fmt::Debug for DatabaseUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Infallible on purpose: clap quotes a value it failed to parse in its
/// error, so the URL is checked later ([`DatabaseUrl::connect_options`]).
impl FromStr for DatabaseUrl {
    type Err = std::convert::Infallible;

    fn from_str(url: &str) -> Result<Self, Self::Err> {
        Ok(Self(url.to_owned()))
    }
}

/// The URL as the url crate reads it: without leading and trailing controls
/// and spaces, and without any tab or newline.
fn normalized(raw: &str) -> String {
    raw.trim_matches(|c: char| c <= ' ')
        .chars()
        .filter(|c| !matches!(c, '\t' | '\n' | '\r'))
        .collect()
}

/// A URL cut where sqlx's reading and its author's agree.
struct Parts<'a> {
    scheme: &'a str,
    /// User information, host and port.
    authority: &'a str,
    path: &'a str,
    /// Without the `?`; the fragment, which sqlx ignores, is dropped.
    query: Option<&'a str>,
}

impl<'a> Parts<'a> {
    fn split(text: &'a str) -> Result<Self, DatabaseUrlError> {
        let (scheme, rest) = text
            .split_once("://")
            .ok_or(DatabaseUrlError::NotPostgres)?;
        if !["postgres", "postgresql"]
            .iter()
            .any(|name| scheme.eq_ignore_ascii_case(name))
        {
            return Err(DatabaseUrlError::NotPostgres);
        }
        let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
        // The author's user information ends at the last '@', sqlx's at the
        // last '@' before the first '/', '?' or '#': the same '@' unless
        // there is one after.
        if tail.contains('@') {
            return Err(DatabaseUrlError::Ambiguous);
        }
        let tail = tail.split_once('#').map_or(tail, |(before, _)| before);
        let (path, query) = match tail.split_once('?') {
            Some((path, query)) => (path, Some(query)),
            None => (tail, None),
        };
        Ok(Self {
            scheme,
            authority,
            path,
            query,
        })
    }

    /// The user name (and whether a password follows it), and the host and port.
    fn user_and_host(&self) -> (Option<(&'a str, bool)>, &'a str) {
        match self.authority.rsplit_once('@') {
            Some((userinfo, host)) => {
                let user = match userinfo.split_once(':') {
                    Some((user, _password)) => (user, true),
                    None => (userinfo, false),
                };
                (Some(user), host)
            }
            None => (None, self.authority),
        }
    }
}

/// The query's parameters as raw text and decoded name, as sqlx splits them.
fn params(query: &str) -> impl Iterator<Item = (&str, Cow<'_, str>)> {
    query.split('&').filter_map(|segment| {
        let (key, _value) = url::form_urlencoded::parse(segment.as_bytes()).next()?;
        Some((segment, key))
    })
}

fn read_by_sqlx(key: &str) -> bool {
    READ_BY_SQLX.contains(&key) || key.starts_with("options[")
}

fn looks_like_password(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["pass", "pwd", "secret"]
        .iter()
        .any(|word| key.contains(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redacted(url: &str) -> String {
        url.parse::<DatabaseUrl>().unwrap().redacted()
    }

    #[test]
    fn the_password_is_never_shown_and_the_rest_is() {
        for (url, shown) in [
            // The two: sqlx would read another host; nothing is shown.
            (
                "postgres://idem:Qx7/SecretTailA@127.0.0.1:1/x",
                NOT_SHOWN_AMBIGUOUS,
            ),
            (
                "postgres://idem:p@ss/w0rd#x?y=z@127.0.0.1:1/x",
                NOT_SHOWN_AMBIGUOUS,
            ),
            ("postgres://idem:a?b@db/x", NOT_SHOWN_AMBIGUOUS),
            ("postgres://idem:a#b@db/x", NOT_SHOWN_AMBIGUOUS),
            (
                "postgres://idem@db/x?application_name=a@b",
                NOT_SHOWN_AMBIGUOUS,
            ),
            // '@' and ':' belong to the password up to the last '@'.
            (
                "postgres://app:s3cr@t@db:5432/x",
                "postgres://app:***@db:5432/x",
            ),
            ("postgres://app:a:b:c@db/x", "postgres://app:***@db/x"),
            ("postgres://app:@db/x", "postgres://app:***@db/x"),
            ("postgres://:hunter2@db/x", "postgres://:***@db/x"),
            ("postgres://app@db/x", "postgres://app@db/x"),
            ("postgres://db/x", "postgres://db/x"),
            (
                "postgres://u:p%40ss%2Fw0rd%3F@db/x",
                "postgres://u:***@db/x",
            ),
            ("postgres://u:pässwörd€@db/x", "postgres://u:***@db/x"),
            ("postgres://u:pass word@db/x", "postgres://u:***@db/x"),
            ("postgres://u:hunter2@db/x#frag", "postgres://u:***@db/x"),
            ("POSTGRESQL://u:hunter2@db/x", "postgresql://u:***@db/x"),
            ("  postgres://u:hunter2@db/x\n", "postgres://u:***@db/x"),
            ("postgres://u:hun\tter2@db/x", "postgres://u:***@db/x"),
            (
                "postgres://u:hunter2@[::1]:5432/x?sslmode=require&connect_timeout=10",
                "postgres://u:***@[::1]:5432/x?sslmode=require",
            ),
            (
                "postgres:///x?host=/var/run/postgresql",
                "postgres:///x?host=/var/run/postgresql",
            ),
            // A password parameter, in any case, anywhere among the others.
            (
                "postgres://db/x?user=a&password=p&sslmode=require",
                "postgres://db/x?user=a&password=***",
            ),
            (
                "postgres://db/x?sslmode=require&PASSWORD=hunter2",
                "postgres://db/x?sslmode=require",
            ),
            (
                "postgres://db/x?pass%77ord=hunter2",
                "postgres://db/x?password=***",
            ),
            ("postgres://db/x?password", "postgres://db/x?password=***"),
            // An unencoded '&' in it starts another parameter: not shown.
            (
                "postgres://db/x?password=ab&host=cd",
                "postgres://db/x?password=***",
            ),
            (
                "postgres://db/x?password:hunter2&sslmode=require",
                "postgres://db/x",
            ),
            (
                "postgres://db/x?sslmode=require&Password=ab&host=cd",
                "postgres://db/x?sslmode=require",
            ),
            // Not a Postgres URL, or not one the url crate reads.
            ("mysql://u:hunter2@db/x", NOT_SHOWN_INVALID),
            ("hunter2", NOT_SHOWN_INVALID),
            ("postgres:u:hunter2@db", NOT_SHOWN_INVALID),
            ("postgres://u:hunter2@db:99999/x", NOT_SHOWN_INVALID),
            ("", NOT_SHOWN_INVALID),
        ] {
            assert_eq!(redacted(url), shown, "{url:?}");
        }
    }

    #[test]
    fn debug_output_is_redacted() {
        let url: DatabaseUrl = "postgres://u:hunter2@h/d".parse().unwrap();
        let debug = format!("{url:?} {:?}", Some(url.clone()));
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("postgres://u:***@h/d"), "{debug}");
    }

    /// Printable ASCII passwords, every character in every position of the
    /// URL forms a password takes: none of the password's substrings of two
    /// characters or more shows, except those the URL around it holds too.
    #[test]
    fn no_password_of_printable_ascii_ever_shows() {
        let printable: Vec<char> = (0x20u8..=0x7e).map(char::from).collect();
        let mut passwords: Vec<String> = Vec::new();
        for &a in &printable {
            for &b in &printable {
                passwords.push(format!("{a}{b}"));
                passwords.push(format!("Zq{a}Wv{b}Kj"));
            }
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..3000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = 2 + (state % 23) as usize;
            let password = (0..len)
                .map(|i| printable[((state >> (i % 8 * 8)) as usize + i * 31) % printable.len()])
                .collect();
            passwords.push(password);
        }
        let forms = [
            "postgres://idem:{p}@db.internal:5432/idempotency?sslmode=require",
            "postgresql://idem:{p}@[::1]/idempotency#{p}",
            "postgres://idem@db.internal/idempotency?sslmode=require&password={p}",
            "postgres://db.internal/idempotency?password={p}&application_name=idem",
            "postgres://idem:{p}@db.internal/idempotency?Password={p}&dbname=x",
            "postgres://idem:{p}@db.internal/idempotency?password={p}&sslmode=require",
        ];
        for form in forms {
            // What the URL around the password shows anyway.
            let around = format!(
                "{} {} {NOT_SHOWN_INVALID} {NOT_SHOWN_AMBIGUOUS}",
                form.replace("{p}", ""),
                redacted(&form.replace("{p}", "X"))
            );
            for password in &passwords {
                let url = form.replace("{p}", password);
                let chars: Vec<char> = password.chars().collect();
                let leaked_from = |text: &str, shortest: usize| {
                    (0..chars.len()).find_map(|start| {
                        (start + shortest..=chars.len()).find_map(|end| {
                            let part: String = chars[start..end].iter().collect();
                            (text.contains(&part) && !around.contains(&part)).then_some(part)
                        })
                    })
                };
                let shown = redacted(&url);
                if let Some(part) = leaked_from(&shown, 2) {
                    panic!("{url:?} shows {part:?}: {shown}");
                }
                // Every other error's text is fixed; sqlx's are the url
                // crate's and std's, which quote nothing either (but hold
                // words like "Utf8Error" and numbers: four characters or more).
                if let Err(DatabaseUrlError::Invalid(error)) =
                    url.parse::<DatabaseUrl>().unwrap().connect_options()
                {
                    let message = format!("{error} {:?}", std::error::Error::source(&error));
                    if let Some(part) = leaked_from(&message, 4) {
                        panic!("{url:?}: the error shows {part:?}: {message}");
                    }
                }
            }
        }
    }

    /// Where the URL is shown, sqlx reads the same user, host and password.
    #[test]
    fn what_is_shown_is_what_sqlx_reads() {
        let printable = (0x20u8..=0x7e).map(char::from);
        for c in printable {
            let password = format!("se{c}cr{c}t");
            let url = format!("postgres://idem:{password}@db.internal:5433/idempotency");
            let database_url: DatabaseUrl = url.parse().unwrap();
            let shown = database_url.redacted();
            if shown.starts_with('<') {
                assert!(database_url.connect_options().is_err(), "{url:?}");
                continue;
            }
            assert_eq!(
                shown, "postgres://idem:***@db.internal:5433/idempotency",
                "{url:?}"
            );
            let options = database_url.connect_options().unwrap();
            assert_eq!(options.get_host(), "db.internal", "{url:?}");
            assert_eq!(options.get_port(), 5433, "{url:?}");
            assert_eq!(options.get_username(), "idem", "{url:?}");
            assert_eq!(options.get_database(), Some("idempotency"), "{url:?}");
            if c != '%' {
                // The options' Debug holds the password as sqlx decoded it.
                let expected = format!("password: Some({password:?})");
                assert!(format!("{options:?}").contains(&expected), "{url:?}");
            }
        }
    }

    #[test]
    fn urls_read_two_ways_and_password_like_parameters_are_refused_without_quoting_them() {
        for (url, refused) in [
            (
                "postgres://idem:Qx7/SecretTailA@127.0.0.1:1/x",
                "would be read with another host",
            ),
            (
                "postgres://idem:p@ss/w0rd#x?y=z@127.0.0.1:1/x",
                "would be read with another host",
            ),
            ("mysql://u:SecretTail@db/x", "must start with postgres://"),
            ("SecretTail", "must start with postgres://"),
            (
                "postgres://db/x?Password=SecretTail",
                "named like a password",
            ),
            ("postgres://db/x?pwd=SecretTail", "named like a password"),
            ("postgres://u:SecretTail@db:99999/x", "not valid"),
        ] {
            let error = url
                .parse::<DatabaseUrl>()
                .unwrap()
                .connect_options()
                .unwrap_err();
            let message = format!("{error} {:?}", std::error::Error::source(&error));
            assert!(message.contains(refused), "{url:?}: {message}");
            assert!(!message.contains("SecretTail"), "{url:?}: {message}");
        }
    }

    #[test]
    fn parameters_sqlx_does_not_read_are_dropped_before_it_reads_them() {
        let url: DatabaseUrl =
            "postgres://u:pw@db/x?password=ab&cd&connect_timeout=5&application_name=me&sslmode=disable"
                .parse()
                .unwrap();
        let options = url.connect_options().unwrap();
        assert_eq!(options.get_application_name(), Some("me"));
        assert!(format!("{options:?}").contains("password: Some(\"ab\")"));
    }

    #[test]
    fn a_url_file_is_read_without_its_trailing_whitespace_and_errors_name_only_the_file() {
        let dir = std::env::temp_dir().join(format!("database-url-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("url");
        std::fs::write(&file, "postgres://u:SecretTail@db/x \n\n").unwrap();
        let empty = dir.join("empty");
        std::fs::write(&empty, " \n").unwrap();
        let missing = dir.join("missing");

        let url = DatabaseUrl::from_file(&file).unwrap();
        let empty = DatabaseUrl::from_file(&empty).unwrap_err();
        let missing = DatabaseUrl::from_file(&missing).unwrap_err();
        let not_text = DatabaseUrl::from_file(&dir).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();

        assert_eq!(url.expose(), "postgres://u:SecretTail@db/x");
        assert!(matches!(empty, DatabaseUrlError::Empty { .. }));
        for error in [empty, missing, not_text] {
            let message = error.to_string();
            assert!(message.contains(dir.to_str().unwrap()), "{message}");
            assert!(!message.contains("SecretTail"), "{message}");
        }
    }
}
