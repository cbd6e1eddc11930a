//! The clients holding the most, for `vovp_client_held_bytes{pid}` and
//! `vovp_client_references{pid}`: the table reports every holder's references and bytes; the
//! server knows each holder's client by the pid its socket was accepted with (SO_PEERCRED).
//! Holders of one process are added up, and only the [`TOP_CLIENTS`] biggest by bytes and the
//! [`TOP_CLIENTS`] biggest by references are reported, so a daemon with thousands of clients
//! writes at most twice that many series per family (bounded cardinality).

use std::collections::HashMap;

use vovp::{HolderId, HolderUsage};

/// Clients reported per ranking (bytes, references).
pub const TOP_CLIENTS: usize = 10;

/// What one client process holds now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientUsage {
    /// Its pid; 0 when unknown (the kernel gave none, or a holder of the daemon's own).
    pub pid: i32,
    pub references: u64,
    pub bytes: u64,
}

/// The holders added up by process, the top `n` by bytes and the top `n` by references (each
/// client once), biggest first by bytes. `pid_of`: a holder's pid, if known.
pub fn top_clients(
    holders: &[HolderUsage],
    pid_of: impl Fn(HolderId) -> Option<i32>,
    n: usize,
) -> Vec<ClientUsage> {
    let mut by_pid: HashMap<i32, ClientUsage> = HashMap::new();
    for h in holders {
        let pid = pid_of(h.holder).unwrap_or(0);
        let c = by_pid.entry(pid).or_insert(ClientUsage {
            pid,
            references: 0,
            bytes: 0,
        });
        c.references += h.references;
        c.bytes += h.bytes;
    }
    let mut all: Vec<ClientUsage> = by_pid.into_values().collect();
    // Ties broken by pid: the same clients are reported from one scrape to the next.
    all.sort_by_key(|c| (std::cmp::Reverse(c.references), c.pid));
    let mut top: Vec<ClientUsage> = all.iter().take(n).copied().collect();
    all.sort_by_key(|c| (std::cmp::Reverse(c.bytes), c.pid));
    for c in all.into_iter().take(n) {
        if !top.iter().any(|t| t.pid == c.pid) {
            top.push(c);
        }
    }
    top.sort_by_key(|c| (std::cmp::Reverse(c.bytes), c.pid));
    top
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(raw: u64, references: u64, bytes: u64) -> HolderUsage {
        HolderUsage {
            holder: HolderId::from_raw(raw),
            references,
            bytes,
        }
    }

    #[test]
    fn holders_of_one_process_add_up_and_only_the_top_are_kept() {
        // Holders 1 and 2 are pid 100's connections; 3 holds many small objects; 4 is unknown.
        let holders = [
            holder(1, 1, 1000),
            holder(2, 1, 500),
            holder(3, 50, 10),
            holder(4, 2, 2),
            holder(5, 1, 1),
        ];
        let pid = |h: HolderId| match h.get() {
            1 | 2 => Some(100),
            3 => Some(300),
            5 => Some(500),
            _ => None,
        };
        let top = top_clients(&holders, pid, 1);
        let rows: Vec<_> = top.iter().map(|c| (c.pid, c.references, c.bytes)).collect();
        // The biggest by bytes (pid 100, both connections) and by references (pid 300).
        assert_eq!(rows, [(100, 2, 1500), (300, 50, 10)]);
        let all = top_clients(&holders, pid, 10);
        assert_eq!(all.len(), 4);
        assert!(all.iter().any(|c| c.pid == 0 && c.bytes == 2));
        assert!(top_clients(&[], pid, 10).is_empty());
    }
}
