# keel_grpc_proto(<target> <proto file>): a static library of the protobuf messages and gRPC
# stubs generated from <proto file> at build time (protoc and grpc_cpp_plugin), its generated
# headers on the include path, linking gRPC C++ and protobuf. For keel's tests, benchmarks and
# examples; the library itself ships no .proto.
include_guard(GLOBAL)

function(keel_grpc_proto target proto)
  find_package(gRPC CONFIG REQUIRED)  # imported targets are seen only where the package is found
  get_filename_component(name ${proto} NAME_WE)
  get_filename_component(dir ${proto} DIRECTORY)
  set(out ${CMAKE_CURRENT_BINARY_DIR}/${target}_generated)
  add_custom_command(
    OUTPUT ${out}/${name}.pb.cc ${out}/${name}.pb.h ${out}/${name}.grpc.pb.cc
           ${out}/${name}.grpc.pb.h
    COMMAND ${CMAKE_COMMAND} -E make_directory ${out}
    COMMAND protobuf::protoc --cpp_out=${out} --grpc_out=${out}
            --plugin=protoc-gen-grpc=$<TARGET_FILE:gRPC::grpc_cpp_plugin> -I ${dir} ${proto}
    DEPENDS ${proto}
    COMMENT "protoc: ${name}.proto")
  add_library(${target} STATIC ${out}/${name}.pb.cc ${out}/${name}.grpc.pb.cc)
  target_include_directories(${target} SYSTEM PUBLIC ${out})
  target_link_libraries(${target} PUBLIC gRPC::grpc++ protobuf::libprotobuf)
endfunction()
