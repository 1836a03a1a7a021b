# cmake --install of the build into a fresh prefix, then the consumer, copied out of the
# source tree as a user's project would be, built and run twice: with `pkg-config --cflags
# --libs minikv` and with find_package(minikv) -> minikv::minikv. Neither route may need a
# CUDA toolkit, whether or not the library was built with CUDA: the package files must not
# look for one, and the CMake consumer is configured with find_package(CUDAToolkit) disabled.
#   -DBUILD_DIR -DWORK_DIR -DCONSUMER_DIR -DC_COMPILER -DGENERATOR -DCONFIG
function(run)
  cmake_parse_arguments(R "" "WHAT;OUT" "COMMAND" ${ARGN})
  execute_process(COMMAND ${R_COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    string(REPLACE ";" " " cmd "${R_COMMAND}")
    message(FATAL_ERROR "${R_WHAT} failed (${rc}): ${cmd}\n${out}\n${err}")
  endif()
  message(STATUS "${R_WHAT}: ok ${out}")
  if(R_OUT)
    set(${R_OUT} "${out}" PARENT_SCOPE)
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
set(config_args)
if(CONFIG)
  set(config_args --config ${CONFIG})
endif()
run(WHAT "cmake --install" COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
    ${config_args})

file(GLOB_RECURSE pcs "${prefix}/*/minikv.pc")
file(GLOB_RECURSE libs "${prefix}/*/libminikv.so")
file(GLOB_RECURSE headers "${prefix}/*/minikv.h")
if(NOT pcs OR NOT libs OR NOT headers)
  message(FATAL_ERROR "install tree incomplete: pc='${pcs}' lib='${libs}' header='${headers}'")
endif()
list(GET pcs 0 pc)
list(GET libs 0 lib)
get_filename_component(pcdir "${pc}" DIRECTORY)
get_filename_component(libdir "${lib}" DIRECTORY)
# The SONAME carries the major version.
file(GLOB sonamed "${libdir}/libminikv.so.[0-9]*")
if(NOT sonamed)
  message(FATAL_ERROR "no versioned libminikv.so.N next to ${lib}")
endif()

# ---- no CUDA for consumers ------------------------------------------------------------
# (minikv.pc may name the CUDA runtime in Libs.private, for static linking only: the flags
# of a normal link are checked below.)
file(GLOB package_files "${libdir}/cmake/minikv/*.cmake")
if(NOT package_files)
  message(FATAL_ERROR "no CMake package files under ${libdir}/cmake/minikv")
endif()
foreach(f IN LISTS package_files)
  file(STRINGS "${f}" cuda_lines REGEX "CUDA::|CUDAToolkit|find_dependency|cudart")
  if(cuda_lines)
    message(FATAL_ERROR "${f} makes consumers look for CUDA: ${cuda_lines}")
  endif()
endforeach()

# The consumer's sources, outside the source tree.
set(consumer_src "${WORK_DIR}/consumer")
file(COPY "${CONSUMER_DIR}/" DESTINATION "${consumer_src}")

# ---- pkg-config consumer ---------------------------------------------------------------
find_program(PKG_CONFIG NAMES pkg-config pkgconf REQUIRED)
run(WHAT "pkg-config --cflags --libs minikv" OUT flags
    COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pcdir}
            ${PKG_CONFIG} --cflags --libs minikv)
string(STRIP "${flags}" flags)
# The flags must point into the prefix the package was installed to (a .pc that names the
# configure-time prefix breaks every `cmake --install --prefix` / relocated install).
if(NOT flags MATCHES "-L${prefix}/" OR NOT flags MATCHES "-I${prefix}/")
  message(FATAL_ERROR "pkg-config flags do not point into the install prefix ${prefix}: "
                      "'${flags}' (minikv.pc is not relocatable: derive prefix from "
                      "\${pcfiledir})")
endif()
string(TOLOWER "${flags}" lower_flags)
if(lower_flags MATCHES "cuda")
  message(FATAL_ERROR "pkg-config flags name CUDA, which consumers need not have: '${flags}'")
endif()
separate_arguments(flag_list UNIX_COMMAND "${flags}")
run(WHAT "cc consumer.c \$(pkg-config ...)"
    COMMAND ${C_COMPILER} -std=c99 -Wall -Wextra -Werror ${consumer_src}/consumer.c
            ${flag_list} -o ${WORK_DIR}/consumer_pkgconfig)
run(WHAT "consumer (pkg-config)"
    COMMAND ${CMAKE_COMMAND} -E env LD_LIBRARY_PATH=${libdir} ${WORK_DIR}/consumer_pkgconfig)

# ---- CMake package consumer ------------------------------------------------------------
run(WHAT "configure consumer (find_package)"
    COMMAND ${CMAKE_COMMAND} -S ${consumer_src} -B ${WORK_DIR}/cmake_consumer -G ${GENERATOR}
            -DCMAKE_C_COMPILER=${C_COMPILER} -DCMAKE_PREFIX_PATH=${prefix}
            -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_BUILD_TYPE=Release
            -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
run(WHAT "build consumer (find_package)"
    COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/cmake_consumer)
file(READ "${WORK_DIR}/cmake_consumer/CMakeCache.txt" cache_txt)
if(NOT cache_txt MATCHES "minikv_DIR:PATH=${prefix}/")
  message(FATAL_ERROR "find_package(minikv) did not find the package in ${prefix}")
endif()
run(WHAT "consumer (find_package)" COMMAND ${WORK_DIR}/cmake_consumer/consumer)
message(STATUS "install test passed: prefix ${prefix}")
