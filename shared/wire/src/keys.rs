//! verl's record keys: a prompt group is `{uid}`, a trajectory `{uid}_{session_id}_{index}` where
//! `session_id` is the sample index within the group and `index` the output index of a multi-output
//! agent loop. A uid never contains `_` (verl splits on it).

use std::fmt;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("uid {0:?} is not valid: it must be non-empty ASCII letters, digits or '-' (no '_', '.', '*', '>')")]
    BadUid(String),
    #[error("trajectory key {0:?} is not of the form {{uid}}_{{session_id}}_{{index}}")]
    BadTrajectoryKey(String),
}

impl KeyError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::BadUid(..) => "bad_uid",
            Self::BadTrajectoryKey(..) => "bad_trajectory_key",
        }
    }
}

/// A fresh group uid: a uuid4 (hyphenated, so no `_`).
pub fn new_uid() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// Checks that a uid can be used in keys and NATS subjects.
pub fn validate_uid(uid: &str) -> Result<(), KeyError> {
    let ok = !uid.is_empty() && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(KeyError::BadUid(uid.to_string()))
    }
}

/// A parsed trajectory key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrajectoryKey {
    pub uid: String,
    pub session_id: u32,
    pub index: u32,
}

impl TrajectoryKey {
    pub fn new(uid: impl Into<String>, session_id: u32, index: u32) -> Self {
        Self { uid: uid.into(), session_id, index }
    }

    /// Parses `{uid}_{session_id}_{index}` from the right, as verl's `rsplit("_", 2)`. The numbers must be
    /// written as [`Display`](fmt::Display) writes them (no sign, no leading zero): `u_+1_0` or `u_01_0` would
    /// otherwise name the same trajectory as `u_1_0` under a different `Nats-Msg-Id`, escaping de-duplication.
    pub fn parse(key: &str) -> Result<Self, KeyError> {
        let bad = || KeyError::BadTrajectoryKey(key.to_string());
        let number = |s: &str| s.parse::<u32>().ok().filter(|n| n.to_string() == s);
        let mut parts = key.rsplitn(3, '_');
        let index = parts.next().and_then(number).ok_or_else(bad)?;
        let session_id = parts.next().and_then(number).ok_or_else(bad)?;
        let uid = parts.next().ok_or_else(bad)?;
        validate_uid(uid).map_err(|_| bad())?;
        Ok(Self { uid: uid.to_string(), session_id, index })
    }
}

impl fmt::Display for TrajectoryKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}_{}_{}", self.uid, self.session_id, self.index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trajectory_key_round_trips_and_uid_is_everything_before_the_first_underscore() {
        let uid = new_uid();
        validate_uid(&uid).unwrap();
        let key = TrajectoryKey::new(uid.clone(), 3, 1).to_string();
        assert_eq!(key.split('_').next().unwrap(), uid);
        assert_eq!(TrajectoryKey::parse(&key).unwrap(), TrajectoryKey::new(uid, 3, 1));
    }

    #[test]
    fn malformed_keys_and_uids_are_rejected() {
        assert!(TrajectoryKey::parse("abc_1").is_err());
        assert!(TrajectoryKey::parse("a_b_1_2").is_err());
        assert!(TrajectoryKey::parse("abc_x_1").is_err());
        // found by the fuzz suite: numbers not written canonically would alias a canonical key
        assert_eq!(TrajectoryKey::parse("u_+0_0"), Err(KeyError::BadTrajectoryKey("u_+0_0".into())));
        assert!(TrajectoryKey::parse("u_01_0").is_err());
        assert!(TrajectoryKey::parse("u_1_+2").is_err());
        assert_eq!(TrajectoryKey::parse("u_0_10"), Ok(TrajectoryKey::new("u", 0, 10)));
        assert!(validate_uid("with_underscore").is_err());
        assert!(validate_uid("dot.ted").is_err());
        assert!(validate_uid("").is_err());
    }

    #[test]
    fn uids_are_unique() {
        let a: std::collections::HashSet<String> = (0..1000).map(|_| new_uid()).collect();
        assert_eq!(a.len(), 1000);
    }
}
