/* Maps each file named on the command line (shared, whole file) and waits for stdin to close.
 * The inventory benchmark runs hundreds of these: a real process per holder, 1 MiB of RSS each. */
#include <fcntl.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        int fd = open(argv[i], O_RDWR);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) { perror(argv[i]); return 1; }
        if (st.st_size && mmap(NULL, st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        if (i % 2) close(fd); /* half held by mapping only, half by mapping and fd */
    }
    printf("ready\n");
    fflush(stdout);
    char buf[1];
    while (read(0, buf, 1) > 0) {}
    return 0;
}
