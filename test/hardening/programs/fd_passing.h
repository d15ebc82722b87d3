// One descriptor over a connected Unix socket (SCM_RIGHTS), as NCCL and
// torch.multiprocessing hand VMM handles between ranks: for the rank programs
// of the shared-memory tests (shared_peer.cc, nccl_rank.cc).
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <cstring>

namespace gpuslice::test {

// Sends `fd` with one byte of data; true when the byte went.
inline bool send_fd(int socket, int fd) {
  char byte = 'h';
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));
  return sendmsg(socket, &msg, 0) == 1;
}

// Receives a descriptor sent by send_fd; -1 if none came.
inline int receive_fd(int socket) {
  char byte = 0;
  iovec io{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  if (recvmsg(socket, &msg, 0) != 1 || CMSG_FIRSTHDR(&msg) == nullptr) return -1;
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(CMSG_FIRSTHDR(&msg)), sizeof(int));
  return fd;
}

}  // namespace gpuslice::test
