//! The TCP connections another process holds, read from outside it: each socket descriptor is
//! duplicated into this process (`pidfd_getfd`, Linux 5.6+, allowed to a parent and to root) and
//! asked for its peer, whether Nagle's algorithm is off (`TCP_NODELAY`) and whether keepalive
//! probes are on (`SO_KEEPALIVE`).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

/// One connected TCP socket of a process.
#[derive(Debug, Clone, Copy)]
pub struct TcpConnection {
    pub peer: SocketAddr,
    /// This end's address: which socket it is, across two looks.
    pub local: SocketAddr,
    /// `TCP_NODELAY`: small writes go out at once instead of waiting for the previous one's ACK.
    pub nodelay: bool,
    /// `SO_KEEPALIVE`: an idle connection whose peer vanished is found by probes.
    pub keepalive: bool,
}

/// Every connected TCP socket of process `pid` (listeners and other descriptors left out).
/// Panics when the process cannot be inspected: a test that cannot see must not pass.
pub fn tcp_connections(pid: u32) -> Vec<TcpConnection> {
    let pidfd = syscall_fd(unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) })
        .unwrap_or_else(|e| panic!("pidfd_open({pid}): {e}"));
    let dir = format!("/proc/{pid}/fd");
    let mut found = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{dir}: {e}")) {
        let Ok(entry) = entry else { continue };
        let is_socket = std::fs::read_link(entry.path())
            .map(|target| target.to_string_lossy().starts_with("socket:"))
            .unwrap_or(false);
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<libc::c_int>().ok())
        else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // The descriptor may have closed since the listing: skip it then.
        let Ok(copy) = syscall_fd(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd, fd, 0) })
        else {
            continue;
        };
        if let Some(conn) = inspect(copy) {
            found.push(conn);
        }
        unsafe { libc::close(copy) };
    }
    unsafe { libc::close(pidfd) };
    found
}

fn syscall_fd(ret: libc::c_long) -> std::io::Result<libc::c_int> {
    if ret < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(ret as libc::c_int)
    }
}

/// The peer and `TCP_NODELAY` of a connected TCP socket; None for anything else.
fn inspect(fd: libc::c_int) -> Option<TcpConnection> {
    let int_opt = |level, name| {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        let rc = unsafe {
            libc::getsockopt(
                fd,
                level,
                name,
                (&mut value as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (rc == 0).then_some(value)
    };
    if int_opt(libc::SOL_SOCKET, libc::SO_TYPE)? != libc::SOCK_STREAM {
        return None;
    }
    // A listener, or not connected: no peer.
    let peer = address(fd, libc::getpeername)?;
    let local = address(fd, libc::getsockname)?;
    let nodelay = int_opt(libc::IPPROTO_TCP, libc::TCP_NODELAY)? != 0;
    let keepalive = int_opt(libc::SOL_SOCKET, libc::SO_KEEPALIVE)? != 0;
    Some(TcpConnection {
        peer,
        local,
        nodelay,
        keepalive,
    })
}

/// The address `get` (`getpeername` or `getsockname`) gives for `fd`; None for a Unix socket
/// or when it fails.
fn address(
    fd: libc::c_int,
    get: unsafe extern "C" fn(
        libc::c_int,
        *mut libc::sockaddr,
        *mut libc::socklen_t,
    ) -> libc::c_int,
) -> Option<SocketAddr> {
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    if unsafe {
        get(
            fd,
            (&mut storage as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    } != 0
    {
        return None;
    }
    Some(match storage.ss_family as libc::c_int {
        libc::AF_INET => {
            let a: libc::sockaddr_in =
                unsafe { std::ptr::read((&storage as *const libc::sockaddr_storage).cast()) };
            SocketAddr::from((
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            ))
        }
        libc::AF_INET6 => {
            let a: libc::sockaddr_in6 =
                unsafe { std::ptr::read((&storage as *const libc::sockaddr_storage).cast()) };
            SocketAddr::from((
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
            ))
        }
        _ => return None, // a Unix socket
    })
}
