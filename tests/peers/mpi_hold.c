/* A tiny MPI job: both ranks hold Open MPI's shared-memory (vader) segments until the
 * release file named by argv[1] appears. Built by the tests with mpicc. */
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int rank, token = 0;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    /* One real message through the vader BTL, so both ranks attach the segments. */
    if (rank == 0) MPI_Send(&token, 1, MPI_INT, 1, 0, MPI_COMM_WORLD);
    else MPI_Recv(&token, 1, MPI_INT, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) { printf("ready\n"); fflush(stdout); }
    while (argc > 1 && access(argv[1], F_OK) != 0) usleep(20000);
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
    return 0;
}
